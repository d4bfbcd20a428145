"""Sampling params validation and the next-token sampler on hand-made logits.

The reported logprob is checked against a reference written here from the definition: the
distribution actually drawn from (softmax of logits / T, cut to the k most likely, then to the
smallest most-likely-first prefix reaching mass top_p, renormalised)."""

import math

import pytest
import torch

from infra.engine.errors import EngineInputError
from infra.engine.sampling import SamplingParams, sample_next

LOGITS = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))  # softmax gives these probs


def drawn_from(logits, params) -> list[float]:
    """Reference: probabilities of the distribution a token is drawn from (plain Python)."""
    z = [float(x) / params.temperature for x in logits]
    m = max(z)
    p = [math.exp(x - m) for x in z]
    p = [x / sum(p) for x in p]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = set(order)
    if 0 < params.top_k < len(p):
        keep = set(order[: params.top_k])
        p = [x if i in keep else 0.0 for i, x in enumerate(p)]
        p = [x / sum(p) for x in p]
    if params.top_p < 1:
        mass, nucleus = 0.0, set()
        for i in order:
            if i in keep and mass < params.top_p:
                nucleus.add(i)
                mass += p[i]
        p = [x if i in nucleus else 0.0 for i, x in enumerate(p)]
    return [x / sum(p) for x in p]


def frequencies(params, n=6000, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(LOGITS))
    q = drawn_from(LOGITS.tolist(), params)
    for _ in range(n):
        tok, lp = sample_next(LOGITS, params, g)
        assert math.isclose(lp, math.log(q[tok]), abs_tol=1e-6), (tok, lp, q)
        counts[tok] += 1
    return counts / n


def test_plain_sampling_follows_the_distribution():
    freq = frequencies(SamplingParams())
    assert torch.allclose(freq, torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]), atol=0.025)


def test_temperature_sharpens():
    freq = frequencies(SamplingParams(temperature=0.5))
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    assert torch.allclose(freq, p / p.sum(), atol=0.025)


def test_top_k_and_top_p_restrict_support():
    freq = frequencies(SamplingParams(top_k=2), n=4000)
    assert torch.allclose(freq, torch.tensor([5 / 7, 2 / 7, 0, 0, 0]), atol=0.03)
    # top_p=0.6: 0.5 alone is short of 0.6, so {0.5, 0.2} is kept
    freq = frequencies(SamplingParams(top_p=0.6), n=4000)
    assert torch.allclose(freq, torch.tensor([5 / 7, 2 / 7, 0, 0, 0]), atol=0.03)
    freq = frequencies(SamplingParams(top_p=0.5), n=2000)
    assert freq[0] == 1.0


def test_reported_logprob_is_the_drawn_distribution_not_the_raw_one():
    """At T != 1 or with top-k/top-p the raw log-softmax is not what the token was drawn
    with; the reported number is (a trainer at the same processing gets ratio 1)."""
    torch.manual_seed(1)
    logits = torch.randn(50) * 3
    raw = torch.log_softmax(logits, -1)
    for params in (
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=7),
        SamplingParams(temperature=0.5, top_k=10, top_p=0.8),
    ):
        q = drawn_from(logits.tolist(), params)
        g = torch.Generator().manual_seed(3)
        gap = 0.0
        for _ in range(30):
            tok, lp = sample_next(logits, params, g)
            assert q[tok] > 0 and math.isclose(lp, math.log(q[tok]), abs_tol=1e-5)
            gap = max(gap, abs(lp - float(raw[tok])))
        assert gap > 0.05, params  # the raw number would be a different one
    # greedy: the raw log-softmax of the argmax
    tok, lp = sample_next(logits, SamplingParams(temperature=0), torch.Generator())
    assert tok == int(logits.argmax()) and math.isclose(lp, float(raw[tok]), abs_tol=1e-6)


def test_greedy_and_seeded_draws():
    assert sample_next(LOGITS, SamplingParams(temperature=0), torch.Generator())[0] == 0
    a = [sample_next(LOGITS, SamplingParams(), torch.Generator().manual_seed(7))[0]]
    b = [sample_next(LOGITS, SamplingParams(), torch.Generator().manual_seed(7))[0]]
    assert a == b


def test_params_validation_reports_every_error():
    with pytest.raises(EngineInputError) as info:
        SamplingParams.from_dict(
            {"temperature": -1, "top_p": 2, "max_new_tokens": 0, "nonsense": 1}
        )
    msg = str(info.value)
    for part in ("temperature", "top_p", "max_new_tokens", "nonsense"):
        assert part in msg
    ok = SamplingParams.from_dict(
        {"max_new_tokens": 5, "stop_token_ids": [3, 4], "skip_special_tokens": True}
    )
    assert ok.max_new_tokens == 5 and ok.stop_token_ids == frozenset({3, 4})


def test_batched_draws_equal_per_row_draws():
    from infra.engine.sampling import sample_batch

    torch.manual_seed(0)
    logits = torch.randn(12, 300) * 2
    params = [
        SamplingParams(
            temperature=[0, 0.7, 1.0, 1.3][i % 4],
            top_p=[1.0, 0.9, 0.5][i % 3],
            top_k=[-1, 20, 0, 5][i % 4],
        )
        for i in range(12)
    ]
    gens_a = [torch.Generator().manual_seed(i) for i in range(12)]
    gens_b = [torch.Generator().manual_seed(i) for i in range(12)]
    for _ in range(5):  # several draws: the generators advance identically too
        batched = sample_batch(logits, params, gens_a)
        rows = [sample_next(logits[i], params[i], gens_b[i]) for i in range(12)]
        assert batched == rows
