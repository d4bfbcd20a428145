"""split_attention.prefix_causal == the textbook masked softmax attention, values and
gradients, in fp64 (prefix lengths 0, 1 and longer; grouped-query heads)."""

from __future__ import annotations

import pytest
import torch

from tasks.train.split_attention import prefix_causal


def _textbook(q, k, v, n_prefix):
    """softmax(q k^T / sqrt(d) + mask) v with key heads repeated for the query heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    n_rows, n_keys = q.shape[2], k.shape[2]
    rows = torch.arange(n_rows)[:, None]
    cols = torch.arange(n_keys)[None, :]
    visible = cols <= n_prefix + rows
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("n_prefix,n_rows", [(0, 6), (1, 1), (9, 4), (70, 33)])
def test_prefix_causal_equals_textbook_fp64(n_prefix, n_rows):
    g = torch.Generator().manual_seed(n_prefix * 100 + n_rows)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)

    q, k, v = (
        rand(1, 4, n_rows, 8),
        rand(1, 2, n_prefix + n_rows, 8),
        rand(1, 2, n_prefix + n_rows, 8),
    )
    upstream = torch.randn(1, 4, n_rows, 8, generator=g, dtype=torch.float64)
    ref = _textbook(q, k, v, n_prefix)
    ref_grads = torch.autograd.grad(ref, (q, k, v), upstream)
    out = prefix_causal(q, k, v, n_prefix)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    assert (out - ref).abs().max() < 1e-12
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        assert (a - b).abs().max() < 1e-12, name


def test_prefix_causal_refuses_a_key_count_that_does_not_add_up():
    q, k = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 7, 4)
    with pytest.raises(ValueError, match="need 8 keys, got 7"):
        prefix_causal(q, k, k, 5)
