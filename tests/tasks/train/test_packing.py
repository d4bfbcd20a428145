"""Packing: ancestor masks and chain plans by hand, partitions, first-fit decreasing."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tasks.train.packing import (
    PackingError,
    ancestor_mask,
    ancestors,
    collate,
    first_fit_decreasing,
    pack,
    partition,
)
from tasks.train.tree_attention import plan
from tasks.trajectory.sampler import build_samples
from tasks.trajectory.synth import random_session
from tasks.trajectory.tree import build_trees

# 0 - 1 - 2
#      \- 3 - 4      5 - 6   (a second tree)
PARENT = np.array([-1, 0, 1, 1, 3, -1, 5])


def test_ancestor_mask_by_hand():
    m = ancestor_mask(PARENT).astype(int)
    assert m.tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 1, 1],
    ]
    assert ancestors(PARENT, 4).tolist() == [0, 1, 3]
    assert ancestors(PARENT, 5).tolist() == []


def test_chain_plan_by_hand_matches_mask():
    p = plan(PARENT)
    assert [(c.start, c.end) for c in p.chains] == [(0, 3), (3, 5), (5, 7)]
    root, mid, second = p.chains
    assert root.keys is None and second.keys is None  # plain causal
    assert mid.keys.tolist() == [0, 1, 3, 4]
    assert mid.mask.int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    # every chain's rows reproduce the dense ancestor mask
    dense = ancestor_mask(PARENT)
    for c in p.chains:
        for j, i in enumerate(range(c.start, c.end)):
            if c.keys is None:
                seen = set(range(c.start, i + 1))
            else:
                seen = set(c.keys[c.mask[j]].tolist())
            assert seen == set(np.flatnonzero(dense[i]).tolist())


def random_sample(seed, n_calls=15):
    """A random tree with mixed-sign weights (both parts on some tokens)."""
    rng = np.random.default_rng(seed)
    recs, spans = random_session(rng, n_calls=n_calls, vocab=8)
    (smp,) = build_samples(build_trees(recs, spans=spans), {"s0": 1.0}, advantage="reward")
    neg = -rng.random(smp.n_tokens) * (smp.counts > 0) * (rng.random(smp.n_tokens) < 0.6)
    return replace(smp, weight_neg=neg)


@pytest.mark.parametrize("seed", range(20))
def test_partition_covers_each_token_once_repeating_only_the_path(seed):
    smp = random_sample(seed)
    depth = int(smp.positions.max()) + 1
    budget = depth + int(np.random.default_rng(seed).integers(1, 12))
    pieces = partition(smp, budget)
    seen = np.zeros(smp.n_tokens, int)
    a = 0
    for piece in pieces:
        assert piece.n_tokens <= budget
        # pieces are: ancestors of the range start (zero weight), then the range
        anc = ancestors(smp.parent_idx, a)
        n_rep = len(anc)
        rng_len = piece.n_tokens - n_rep
        idx = np.concatenate([anc, np.arange(a, a + rng_len)])
        assert np.array_equal(piece.token_ids, smp.token_ids[idx])
        assert np.array_equal(piece.positions, smp.positions[idx])
        assert not piece.weight_pos[:n_rep].any() and not piece.weight_neg[:n_rep].any()
        assert not piece.counts[:n_rep].any()  # the repeated path trains in its own piece
        assert np.array_equal(piece.weight_pos[n_rep:], smp.weight_pos[a : a + rng_len])
        assert np.array_equal(piece.weight_neg[n_rep:], smp.weight_neg[a : a + rng_len])
        assert np.array_equal(piece.counts[n_rep:], smp.counts[a : a + rng_len])
        # local parents map back to the global parents
        glob_parent = np.where(piece.parent_idx >= 0, idx[np.maximum(piece.parent_idx, 0)], -1)
        assert np.array_equal(glob_parent, smp.parent_idx[idx])
        seen[a : a + rng_len] += 1
        a += rng_len
    assert (seen == 1).all()
    assert sum(p.weight_pos.sum() for p in pieces) == pytest.approx(smp.weight_pos.sum())
    assert sum(p.weight_neg.sum() for p in pieces) == pytest.approx(smp.weight_neg.sum())
    assert smp.weight_neg.min() < 0 < smp.weight_pos.max()
    assert sum(int(p.counts.sum()) for p in pieces) == int(smp.counts.sum())


def test_partition_refuses_a_path_longer_than_the_budget():
    smp = random_sample(0)
    with pytest.raises(PackingError, match="raise max_tokens_per_micro"):
        partition(smp, int(smp.positions.max()))


def test_first_fit_decreasing_by_hand():
    assert first_fit_decreasing([5, 4, 3, 2, 1], 6) == [[0, 4], [1, 3], [2]]
    assert first_fit_decreasing([7, 1], 6) == [[0], [1]]  # too big: alone


def test_pack_respects_budget_and_keeps_weights():
    samples = [random_sample(s, n_calls=8) for s in range(6)]
    budget = max(s.n_tokens for s in samples) * 3 // 2
    packs = pack(samples, budget)
    assert all(p.n_tokens <= budget for p in packs)
    for f in ("weight_pos", "weight_neg", "counts"):
        assert sum(getattr(p, f).sum() for p in packs) == pytest.approx(
            sum(getattr(s, f).sum() for s in samples)
        )
    assert len(packs) < sum(
        len(partition(s, budget)) for s in samples
    )  # pieces share micro-batches
    c = collate(samples[:2])
    assert c.parent_idx[samples[0].n_tokens] == -1  # second tree starts a new root
    assert (c.parent_idx < np.arange(c.n_tokens)).all()


def test_chain_blocks_split_long_chains_exactly():
    # a root chain of 5 tokens, then a chain of 7 hanging below token 2: blocks of 3
    parent = np.array([-1, 0, 1, 2, 3, 2, 5, 6, 7, 8, 9, 10])
    p = plan(parent, block=3)
    root, sub = p.chains
    assert (root.start, root.end, sub.start, sub.end) == (0, 5, 5, 12)
    assert sub.keys.tolist() == [0, 1, 2, *range(5, 12)]
    assert [(b.q_lo, b.q_hi, b.n_keys) for b in sub.blocks] == [(5, 8, 6), (8, 11, 9), (11, 12, 10)]
    dense = ancestor_mask(parent)
    for j, i in enumerate(range(5, 12)):
        assert set(sub.keys[sub.mask[j]].tolist()) == set(np.flatnonzero(dense[i]).tolist())
