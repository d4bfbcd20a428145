"""Long-context serving: the tiny model's context is configurable, and one session growing over
many calls is served token-exact with each call prefilling only its new tokens."""

import pytest
import torch

from infra.engine.engine import Engine
from infra.engine.errors import EngineInputError
from infra.engine.tiny_model import _default_dir, make_tiny_model


def ids_of(n, start):
    return [(start + 13 * i) % 900 + 5 for i in range(n)]


def greedy_reference(model, ids, n):
    """Textbook greedy decoding: a full forward over the whole sequence per token."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            out.append(int(torch.argmax(logits)))
    return out


def test_cache_key_names_the_context_setting():
    assert _default_dir(0, "qwen3") != _default_dir(0, "qwen3", 262144)
    assert _default_dir(0, "qwen3", 32768).name == "tiny-qwen3-s0"  # old callers unchanged


def test_context_setting_is_what_the_engine_serves(tmp_path):
    short = make_tiny_model(tmp_path / "short", max_position_embeddings=256)
    long_ = make_tiny_model(tmp_path / "long", max_position_embeddings=1024)
    # A directory built for one setting is rebuilt, not reused, for another.
    assert make_tiny_model(tmp_path / "short", max_position_embeddings=512)
    eng = Engine(long_)
    try:
        info = eng.model_info()
        assert info["max_context_length"] == 1024
        # layers 2 x (k, v) x kv heads 2 x head dim 16 x fp32 4 B, counted by hand
        assert info["kv_bytes_per_token"] == eng.load()["kv_bytes_per_token"] == 512
        res = eng.generate(ids_of(600, 1), {"max_new_tokens": 2, "temperature": 0})
        assert len(res["output_ids"]) >= 1
    finally:
        eng.close()
    eng = Engine(short)
    try:
        with pytest.raises(EngineInputError):
            eng.generate(ids_of(600, 1), {"max_new_tokens": 2, "temperature": 0})
    finally:
        eng.close()


def test_growing_session_is_token_exact_and_prefills_only_new_tokens(tmp_path):
    from transformers import AutoModelForCausalLM

    d = make_tiny_model(tmp_path / "m", max_position_embeddings=65536)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    eng = Engine(d)
    try:
        ids: list[int] = []
        for turn in range(5):
            new = ids_of(300, turn)
            ids = ids + new
            res = eng.generate(ids, {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
            out = res["output_ids"]
            assert out == greedy_reference(ref, ids, 4), f"turn {turn}"
            cached = res["meta_info"]["cached_tokens"]
            if turn:  # all but this turn's new tokens came from the radix cache (the last
                # generated token of the previous turn was never fed, so it has no KV yet)
                assert cached == len(ids) - len(new) - 1, (turn, cached)
            ids = ids + out
    finally:
        eng.close()


@pytest.mark.slow
def test_session_past_the_old_32k_limit_is_token_exact(tmp_path):
    """One session past 32768 positions (the tiny model's old limit), grown in two calls."""
    from transformers import AutoModelForCausalLM

    d = make_tiny_model(tmp_path / "m", max_position_embeddings=262144)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    eng = Engine(d, kv_cache_tokens=1 << 20)
    try:
        ids = ids_of(33000, 2)
        out = eng.generate(ids, {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
        ids = ids + out["output_ids"] + ids_of(1000, 5)
        res = eng.generate(ids, {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
        assert res["meta_info"]["cached_tokens"] >= 33000
        assert res["output_ids"] == greedy_reference(ref, ids, 2)
    finally:
        eng.close()


def test_interleaved_sessions_under_a_small_budget_match_an_unbounded_engine(tmp_path):
    """Two growing sessions whose KV together exceeds the budget: each call evicts the other
    session's prefix, which is then recomputed; outputs equal an unbounded engine's."""
    d = make_tiny_model(tmp_path / "m", max_position_embeddings=4096)
    small, big = Engine(d, kv_cache_tokens=1200), Engine(d, kv_cache_tokens=1 << 20)
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    try:
        sessions: list[list[int]] = [[], []]
        recomputed = 0
        for turn in range(4):
            for s in range(2):
                ids = sessions[s] + ids_of(200, 10 * s + turn)
                a, b = small.generate(ids, params), big.generate(ids, params)
                assert a["output_ids"] == b["output_ids"], (turn, s)
                if turn:
                    recomputed += a["meta_info"]["cached_tokens"] < b["meta_info"]["cached_tokens"]
                sessions[s] = ids + a["output_ids"]
        assert recomputed, "the budget never forced an eviction: the test proves nothing"
        assert small.load()["kv_tokens_peak"] <= 1200
    finally:
        small.close()
        big.close()
