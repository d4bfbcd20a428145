"""Batched prefill: waiting prompts go through one forward together, and compute what they
compute one at a time (cached prefixes, padding, RL groups of one prompt included)."""

import pytest
import torch

from infra.engine.batch_kv import prefill_mask
from infra.engine.engine import Engine
from infra.engine.tiny_model import ARCHS, make_tiny_model

MIN = torch.finfo(torch.float32).min


def test_prefill_mask_by_hand():
    # row 0: no cached tokens, 2 new; row 1: 2 cached, 1 new (P = 2, Q = 2, 4 columns)
    mask = prefill_mask([0, 2], [2, 1], torch.float32)
    assert mask.shape == (2, 1, 2, 4)
    allowed = (mask[:, 0] == 0).int().tolist()
    assert allowed[0] == [[0, 0, 1, 0], [0, 0, 1, 1]]  # causal over its own new tokens
    # row 1: a padding query (itself only), then its token: the cached two and itself
    assert allowed[1] == [[0, 0, 1, 0], [1, 1, 0, 1]]
    assert set(mask.unique().tolist()) == {0.0, MIN}


def prompt_of(n, start=3):
    return [(start + 7 * i) % 1000 + 5 for i in range(n)]


@pytest.fixture(scope="module", params=ARCHS)
def engine(request, tmp_path_factory):
    path = make_tiny_model(
        tmp_path_factory.mktemp("prefill") / request.param, seed=0, arch=request.param
    )
    eng = Engine(path, max_batch_size=16)
    yield eng
    eng.close()


def _together(eng: Engine, prompts, params):
    """Submit while paused, so that the scheduler sees them all waiting at once."""
    eng.pause_generation("in_place")
    reqs = [eng.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
    eng.continue_generation()
    for r in reqs:
        assert r.done.wait(60)
    return reqs


def test_waiting_prompts_prefill_in_one_forward_as_one_by_one(engine):
    shared = prompt_of(24, start=40)
    engine.flush_cache()
    engine.generate(shared + [1], {"max_new_tokens": 1})  # `shared` is now cached
    # different lengths (padding), two with a cached prefix, mixed sampling
    prompts = [
        prompt_of(20, 1),
        shared + prompt_of(18, 9),
        prompt_of(22, 2),
        shared + prompt_of(19, 11),
    ]
    params = [
        {"max_new_tokens": 6, "ignore_eos": True}
        | ({"temperature": 0} if i % 2 else {"temperature": 0.9, "sampling_seed": i})
        for i in range(4)
    ]
    forwards = engine.stats["engine/prefill_forwards"]
    reqs = _together(engine, prompts, params)
    assert engine.stats["engine/prefill_forwards"] == forwards + 1
    assert [r.cached_tokens for r in reqs] == [0, 24, 0, 24]
    engine.flush_cache()
    engine.generate(shared + [1], {"max_new_tokens": 1})
    for p, sp, r in zip(prompts, params, reqs, strict=True):
        one = engine.generate(p, sp)
        assert one["output_ids"] == r.output_ids
        assert one["meta_info"]["cached_tokens"] == r.cached_tokens
        lps = [x[0] for x in one["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(lps, r.output_logprobs, strict=True)) <= 1e-4


def test_copies_of_one_prompt_compute_it_once(engine):
    """An RL group: the copies wait for the first one's KV, as they would one by one."""
    engine.flush_cache()
    p = prompt_of(30, start=77)
    tokens = engine.stats["engine/prefill_tokens"]
    forwards = engine.stats["engine/prefill_forwards"]
    reqs = _together(engine, [p] * 4, [{"max_new_tokens": 3, "sampling_seed": i} for i in range(4)])
    assert [r.cached_tokens for r in reqs] == [0, 29, 29, 29]
    assert engine.stats["engine/prefill_tokens"] == tokens + 30 + 3
    assert engine.stats["engine/prefill_forwards"] == forwards + 2  # the first, then 3 copies


def test_padding_is_bounded(engine):
    """A short prompt behind a long one is not padded to its length: separate forwards."""
    engine.flush_cache()
    forwards = engine.stats["engine/prefill_forwards"]
    _together(engine, [prompt_of(200, 5), prompt_of(10, 6)], [{"max_new_tokens": 1}] * 2)
    assert engine.stats["engine/prefill_forwards"] == forwards + 2
