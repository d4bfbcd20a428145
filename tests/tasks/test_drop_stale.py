"""The step's staleness drop (``drop_stale`` in tasks/train_step.py) is the sampler's drop.

A token older than the bound counts nowhere: no loss weight, no branch count (the KL and
entropy terms weigh tokens by it), not in the loss normaliser ``n_flat_trainable`` nor in
``n_trainable``; a token of lag ``max_staleness`` is kept, one of ``max_staleness + 1`` is
dropped. Before issue 15 the step's drop only zeroed the weights: the normaliser still
counted the dropped tokens, and an off-by-one in the bound passed every test.
"""

from __future__ import annotations

import numpy as np
import pytest

from tasks.train_step import drop_stale
from tasks.trajectory.sampler import Sample, build_samples
from tasks.trajectory.synth import random_session
from tasks.trajectory.tree import build_trees
from tests.tasks.trajectory.test_sampler import small_tree

ARRAYS = ("token_ids", "parent_idx", "weight_pos", "weight_neg", "versions", "counts")


def _sample(versions) -> Sample:
    """small_tree: a [1 2 | 3 4], b retries a's output [5 6], c extends a [7 | 8], d [9];
    reward 1, so every trainable token has weight = the branches through it. Unpruned."""
    (s,) = build_samples(
        [small_tree(versions=versions)], {"s": 1.0}, advantage="reward", prune=False
    )
    return s


def test_dropped_tokens_leave_the_normaliser_and_the_counts():
    s = _sample((0, 2, 2, 2))  # a's output (3 4) is v0, the rest v2
    assert s.n_flat_trainable == 5 and s.n_trainable == 5  # b: 5 6; d: 3 4 8
    kept, n = drop_stale(s, version=3, max_lag=1)  # bound: v >= 2
    assert n == 2
    tok = kept.token_ids.tolist()
    for t in (3, 4):
        i = tok.index(t)
        assert kept.weight_pos[i] == 0 and kept.weight_neg[i] == 0 and kept.counts[i] == 0
    for t in (5, 6, 8):
        i = tok.index(t)
        assert kept.weight_pos[i] == 1 and kept.counts[i] == 1
    # the normaliser is the count of kept tokens over branches: b's 5 6 and d's 8
    assert kept.n_flat_trainable == 3
    assert kept.n_trainable == 3
    assert kept.token_ids.tolist() == s.token_ids.tolist()  # the context stays
    assert s.n_flat_trainable == 5 and s.counts[tok.index(3)] == 1  # the input is not changed


@pytest.mark.parametrize("max_lag", [0, 1, 2])
def test_lag_at_the_bound_is_kept_and_one_past_it_dropped(max_lag):
    v = 5
    at_bound = _sample((v - max_lag,) * 4)
    same, n = drop_stale(at_bound, version=v, max_lag=max_lag)
    assert n == 0 and same.n_flat_trainable == at_bound.n_flat_trainable == 5
    past = _sample((v - max_lag - 1,) * 4)
    gone, n = drop_stale(past, version=v, max_lag=max_lag)
    assert n == 5 and gone.n_flat_trainable == 0 and gone.n_trainable == 0
    assert not gone.counts.any() and not gone.weight_pos.any()


@pytest.mark.parametrize("seed", range(12))
def test_the_step_drop_equals_the_sampler_drop(seed):
    rng = np.random.default_rng(seed)
    recs = []
    for k in range(3):
        r, _ = random_session(rng, n_calls=int(rng.integers(2, 14)), session_id=f"s{k}")
        recs += r
    trees = build_trees(recs)
    vmax = max(r.weight_version for r in recs)
    rewards = {f"s{k}": float(rng.random()) for k in range(3)}
    groups = dict.fromkeys(rewards, "g")
    current, max_lag = vmax + int(rng.integers(0, 2)), int(rng.integers(0, 3))
    common = {"prune": False, "filter_zero_variance": False, "run_id": "r"}
    plain = build_samples(trees, rewards, groups, **common)
    ref = build_samples(
        trees, rewards, groups, current_version=current, max_staleness=max_lag, **common
    )
    for a, b in zip(plain, ref, strict=True):
        got, n = drop_stale(a, current, max_lag)
        assert n == a.n_trainable - b.n_trainable
        for f in ARRAYS:
            np.testing.assert_array_equal(getattr(got, f), getattr(b, f), err_msg=f)
        assert got.n_flat_trainable == b.n_flat_trainable
        assert got.n_trainable == b.n_trainable
