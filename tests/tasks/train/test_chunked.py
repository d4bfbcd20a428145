"""Chunked forward/backward (tasks/train/chunked.py) == one forward, float64 to 1e-12.

Reference: the one-forward tree stats over the whole packed tree (itself checked against
flat per-branch training in test_exactness / test_tree_train). Random trees with branches
and context resets whose paths are longer than the chunk; chunk sizes below a chain,
at a branch point, and larger than the tree.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tasks.train.chunked import chunked_token_stats
from tasks.train.packed_loss import keep_norms_in_fp64, packed_token_stats
from tasks.train.packing import Packed
from tests.models import micro_config

VOCAB = 40


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(micro_config("qwen3", VOCAB)).to(torch.float64)
    keep_norms_in_fp64(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _tree(rng: np.random.Generator, n: int) -> Packed:
    """Topologically ordered random tree: mostly chains, some branches, some new roots."""
    parent = np.empty(n, np.int64)
    depth = np.empty(n, np.int64)
    for i in range(n):
        u = rng.random()
        if i == 0 or u < 0.01:
            parent[i] = -1
        elif u < 0.05:
            parent[i] = rng.integers(0, i)
        else:
            parent[i] = i - 1
        depth[i] = 0 if parent[i] < 0 else depth[parent[i]] + 1
    z = np.zeros(n)
    return Packed(
        token_ids=rng.integers(0, VOCAB, n),
        parent_idx=parent,
        positions=depth,
        weight_pos=z,
        weight_neg=z,
        behaviour_logprobs=z,
        versions=np.zeros(n, np.int64),
        sample_ids=["t"],
        counts=np.ones(n, np.int64),
    )


def _grads(model, fn):
    model.zero_grad()
    logp, ent = fn()
    w = torch.linspace(-1, 1, len(logp), dtype=logp.dtype)
    loss = (w * logp).sum() + 0.3 * ent.sum()
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("chunk", [7, 16, 33, 200])
def test_chunked_equals_one_forward_fp64(chunk):
    model = _model(0)
    p = _tree(np.random.default_rng(chunk), 120)
    assert p.positions.max() + 1 > chunk or chunk >= 120  # paths longer than the chunk
    sel = np.flatnonzero(p.parent_idx >= 0)
    l0, g0 = _grads(model, lambda: packed_token_stats(model, p, sel, entropy=True))
    l1, g1 = _grads(
        model,
        lambda: chunked_token_stats(
            model, p.token_ids, p.positions, p.parent_idx, sel, chunk, entropy=True
        ),
    )
    assert abs(float(l0 - l1)) <= 1e-12
    for k in g0:
        assert torch.max(torch.abs(g0[k] - g1[k])) <= 1e-12, k


def test_chunk_boundary_at_branch_point():
    model = _model(1)
    p = _tree(np.random.default_rng(5), 60)
    branch = np.flatnonzero((p.parent_idx >= 0) & (p.parent_idx != np.arange(60) - 1))
    chunk = int(branch[len(branch) // 2])  # a boundary right at a branch's first token
    sel = np.flatnonzero(p.parent_idx >= 0)
    l0, g0 = _grads(model, lambda: packed_token_stats(model, p, sel, entropy=True))
    l1, g1 = _grads(
        model,
        lambda: chunked_token_stats(
            model, p.token_ids, p.positions, p.parent_idx, sel, chunk, entropy=True
        ),
    )
    assert abs(float(l0 - l1)) <= 1e-12
    for k in g0:
        assert torch.max(torch.abs(g0[k] - g1[k])) <= 1e-12, k
