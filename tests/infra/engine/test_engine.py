"""Embedded engine: correctness of logprobs, caching, batching, sampling and stops.

The exactness tests (logprobs, greedy, prefix cache, batched == serial) run on the tiny model
of each architecture family (Qwen3, Llama as SmolLM2, Qwen2); the rest on Qwen3.
"""

import pytest
import torch

from infra.engine.engine import Engine
from infra.engine.errors import EngineInputError
from infra.engine.tiny_model import ARCHS, make_tiny_model

every_arch = pytest.mark.parametrize("model_dir", ARCHS, indirect=True)


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory):
    arch = getattr(request, "param", "qwen3")
    return make_tiny_model(tmp_path_factory.mktemp("engine") / arch, seed=0, arch=arch)


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = Engine(model_dir, max_batch_size=16)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def ref_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def recompute_logprobs(model, prompt, output, params=None):
    """Full forward over prompt + output; logprob of each output token under the distribution
    it was drawn from: logits / temperature, top-k, then top-p (smallest most-likely-first
    prefix reaching the mass), renormalised; raw logits when greedy or no params."""
    p = params or {}
    t = p.get("temperature", 1.0) or 1.0
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float() / t
    k, top_p = p.get("top_k", -1), p.get("top_p", 1.0)
    if 0 < k < logits.shape[-1]:
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        probs, order = torch.sort(torch.softmax(logits, -1), dim=-1, descending=True)
        cut = (torch.cumsum(probs, -1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(cut).scatter(1, order, cut), float("-inf"))
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


def prompt_of(n, start=3):
    return [(start + 7 * i) % 1000 + 5 for i in range(n)]


@every_arch
@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0},
        {"temperature": 1.0, "sampling_seed": 1},
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "sampling_seed": 2},
    ],
)
def test_logprobs_match_full_recompute(engine, ref_model, params):
    prompt = prompt_of(40)
    res = engine.generate(prompt, {"max_new_tokens": 24, "ignore_eos": True, **params})
    out = res["output_ids"]
    assert len(out) == 24 and res["meta_info"]["finish_reason"]["type"] == "length"
    got = [lp for lp, tok, _ in res["meta_info"]["output_token_logprobs"]]
    assert [tok for _, tok, _ in res["meta_info"]["output_token_logprobs"]] == out
    ref = recompute_logprobs(ref_model, prompt, out, params)
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) <= 1e-4


@every_arch
def test_greedy_matches_reference_argmax(engine, ref_model):
    prompt = prompt_of(30, start=11)
    out = engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(ref_model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert out["output_ids"] == ids[len(prompt) :]


@every_arch
def test_prefix_cache_hits_and_does_not_change_output(engine, ref_model):
    engine.flush_cache()
    shared = prompt_of(64, start=5)
    a = engine.generate([*shared, 7, 8], {"max_new_tokens": 8, "temperature": 0})
    assert a["meta_info"]["cached_tokens"] == 0
    b = engine.generate([*shared, 9, 10, 11], {"max_new_tokens": 8, "temperature": 0})
    assert b["meta_info"]["cached_tokens"] == 64
    # the same prompt again: everything but the last token comes from the cache
    c = engine.generate([*shared, 9, 10, 11], {"max_new_tokens": 8, "temperature": 0})
    assert c["meta_info"]["cached_tokens"] == 66
    assert c["output_ids"] == b["output_ids"]
    got = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
    ref = recompute_logprobs(ref_model, [*shared, 9, 10, 11], b["output_ids"])
    assert max(abs(x - y) for x, y in zip(got, ref, strict=True)) <= 1e-4
    # a new turn extending prompt + output reuses the output's KV too
    turn2 = shared + [9, 10, 11] + c["output_ids"] + [12, 13]
    d = engine.generate(turn2, {"max_new_tokens": 4, "temperature": 0})
    assert d["meta_info"]["cached_tokens"] >= 66 + len(c["output_ids"]) - 1


@every_arch
def test_batched_equals_serial_for_seeded_and_greedy(engine):
    prompts = [prompt_of(20 + 3 * i, start=i) for i in range(12)]
    params = [
        {"max_new_tokens": 16, "ignore_eos": True}
        | ({"temperature": 0} if i % 2 else {"temperature": 0.9, "sampling_seed": 100 + i})
        for i in range(12)
    ]
    engine.flush_cache()
    serial = [engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True)]
    engine.flush_cache()
    reqs = [engine.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
    for r in reqs:
        assert r.done.wait(60)
    assert engine.stats["engine/decode_steps"] > 0
    for s, r in zip(serial, reqs, strict=True):
        assert r.output_ids == s["output_ids"]
        lps = [x[0] for x in s["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(r.output_logprobs, lps, strict=True)) <= 1e-4


def test_seed_reproducible_and_different_seeds_differ(engine):
    p = prompt_of(16)
    sp = {"max_new_tokens": 20, "temperature": 1.0, "ignore_eos": True}
    a = engine.generate(p, sp | {"sampling_seed": 5})["output_ids"]
    b = engine.generate(p, sp | {"sampling_seed": 5})["output_ids"]
    c = engine.generate(p, sp | {"sampling_seed": 6})["output_ids"]
    assert a == b and a != c


def test_top_k_one_is_greedy(engine):
    p = prompt_of(16, start=2)
    greedy = engine.generate(p, {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
    topk1 = engine.generate(
        p, {"max_new_tokens": 10, "top_k": 1, "sampling_seed": 3, "ignore_eos": True}
    )
    assert greedy["output_ids"] == topk1["output_ids"]
    # reported logprobs are of the distribution sampled from: top-k 1 is a point mass
    assert all(lp == 0.0 for lp, _, _ in topk1["meta_info"]["output_token_logprobs"])


def test_tiny_top_p_keeps_only_the_top_token(engine):
    p = prompt_of(16, start=8)
    greedy = engine.generate(p, {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
    nucleus = engine.generate(
        p, {"max_new_tokens": 10, "top_p": 1e-6, "sampling_seed": 4, "ignore_eos": True}
    )
    assert nucleus["output_ids"] == greedy["output_ids"]


def test_new_request_joins_while_others_decode(engine):
    long = engine.submit(
        prompt_of(30), {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    )
    while len(long.output_ids) < 5:
        long.done.wait(0.005)
    short = engine.submit(prompt_of(12, start=9), {"max_new_tokens": 3, "temperature": 0})
    assert short.done.wait(30)
    assert not long.done.is_set()  # the short one was admitted mid-run and finished first
    assert long.done.wait(60) and len(long.output_ids) == 400


def test_stop_token_and_eos(engine):
    p = prompt_of(16, start=4)
    free = engine.generate(p, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    stop_at = free["output_ids"][5]
    first = free["output_ids"].index(stop_at)
    res = engine.generate(p, {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop_at]})
    assert res["output_ids"] == free["output_ids"][: first + 1]
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    # eos stops by default, and not with ignore_eos: make the 4th greedy token "eos"
    fake_eos = free["output_ids"][3]
    real_eos = engine.eos_token_ids
    engine.eos_token_ids = [fake_eos]
    try:
        r = engine.generate(p, {"max_new_tokens": 12, "temperature": 0})
        ignored = engine.generate(p, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    finally:
        engine.eos_token_ids = real_eos
    stop = free["output_ids"].index(fake_eos)
    assert r["output_ids"] == free["output_ids"][: stop + 1]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": fake_eos}
    assert ignored["output_ids"] == free["output_ids"]
    assert real_eos[0] == engine.tokenizer.eos_token_id  # <|im_end|> is the real one


def test_stop_strings(engine):
    p = prompt_of(16, start=6)
    free = engine.generate(p, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
    ids, tok = free["output_ids"], engine.tokenizer
    # a stop string spanning the boundary between output tokens 5 and 6
    left, right = tok.decode(ids[:6]), tok.decode(ids[:7])
    stop = left[-2:] + right[len(left) : len(left) + 1]
    assert len(stop) == 3
    res = engine.generate(
        p, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    )
    n = next(k for k in range(1, 17) if stop in tok.decode(ids[:k]))
    assert res["output_ids"] == ids[:n]
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    full = tok.decode(ids[:n])
    assert res["text"] == full[: full.index(stop)]  # trimmed, as SGLang does
    kept = engine.generate(
        p, {"max_new_tokens": 16, "temperature": 0, "stop": stop, "no_stop_trim": True}
    )
    assert kept["text"] == full


def test_unsupported_params_are_rejected_not_ignored(engine):
    for bad in ({"n": 2}, {"frequency_penalty": 0.5}, {"regex": "a+"}, {"stop": 5}):
        with pytest.raises(EngineInputError):
            engine.submit([1, 2, 3], bad)
    ok = {"n": 1, "frequency_penalty": 0.0, "skip_special_tokens": False, "regex": None}
    assert engine.generate([1, 2, 3], ok | {"max_new_tokens": 2})["output_ids"]


def test_invalid_input_is_rejected(engine):
    with pytest.raises(EngineInputError):
        engine.submit([1, engine.vocab_size], {})
    with pytest.raises(EngineInputError):
        engine.submit([], {})
    with pytest.raises(EngineInputError):
        engine.submit([1, 2], {"temperature": -1})
    with pytest.raises(EngineInputError):
        engine.submit([1] * engine.max_context, {})
    assert engine.generate([1, 2, 3], {"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1


def test_context_limit_finishes_with_length(model_dir):
    eng = Engine(model_dir)
    try:
        eng.max_context = 40  # pretend a short context
        res = eng.generate(prompt_of(30), {"max_new_tokens": 50, "ignore_eos": True})
        assert res["meta_info"]["finish_reason"]["type"] == "length"
        assert len(res["output_ids"]) == 10
    finally:
        eng.close()


@pytest.mark.slow
def test_throughput_16_sessions_at_least_4x_serial(model_dir):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from bench.engine import bench_batching

    figures, details = bench_batching(model_dir, quick=False)
    assert details["seeded_outputs_identical"]
    assert figures["batched_over_serial_16"] >= 4.0, details


@pytest.mark.slow
def test_kv_move_8k_costs_at_most_a_fifth_of_reprefill(model_dir):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from bench.engine import bench_kv_move

    figures, details = bench_kv_move(model_dir, quick=True)
    assert details["moved_output_identical"]
    assert figures["kv_move_over_prefill_8k"] <= 0.2, details
