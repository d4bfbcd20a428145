"""Sampling params validation and the next-token sampler on hand-made logits."""

import math

import pytest
import torch

from infra.engine.errors import EngineInputError
from infra.engine.sampling import SamplingParams, sample_next

LOGITS = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))  # softmax gives these probs


def frequencies(params, n=6000, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(LOGITS))
    for _ in range(n):
        tok, lp = sample_next(LOGITS, params, g)
        assert math.isclose(lp, float(torch.log_softmax(LOGITS, -1)[tok]), abs_tol=1e-6)
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
