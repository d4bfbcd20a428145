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


@pytest.fixture(scope="module")
def qwen3_dirs(tmp_path_factory):
    from tests.tasks.train.test_exactness import _save_model

    d = tmp_path_factory.mktemp("chunked-qwen3")
    return _save_model(d / "policy", 0, "qwen3"), _save_model(d / "reference", 1, "qwen3")


@pytest.mark.parametrize("seed", [0, 3, 5, 6])
def test_trainer_trains_paths_deeper_than_the_budget_exactly(seed, qwen3_dirs):
    """The real Trainer path (build_trees -> build_samples -> Trainer.loss_and_grads) with
    max_tokens_per_micro below the deepest path (staleness, normaliser, KL, entropy as the
    random case draws them) == test_exactness's textbook flat reference, fp64."""
    from tests.tasks.train.test_exactness import (
        contexts,
        load,
        make_case,
        project_loss,
        reference_loss,
    )

    c = make_case(seed)
    depth = max(len(p[0]) for p in contexts(c.records, c.spans).values())
    c.max_tokens = max(3, depth // 3)  # the old packer raised PackingError here
    policy_dir, ref_dir = qwen3_dirs
    m, grads, samples = project_loss(c, policy_dir, ref_dir)
    assert any(int(s.positions.max()) + 1 > c.max_tokens for s in samples)
    model, ref_model = load(policy_dir), load(ref_dir)
    loss, stats = reference_loss(c, model, ref_model)
    if loss.requires_grad:
        loss.backward()
    ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert abs(m["loss"] - float(loss.detach())) <= 1e-12, (m["loss"], float(loss), stats)
    assert grads.keys() == ref.keys()
    for k in ref:
        assert float((grads[k] - ref[k]).abs().max()) <= 1e-12 * max(
            1.0, float(ref[k].abs().max())
        ), k
