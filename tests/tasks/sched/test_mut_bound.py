"""`estimate` on a workload whose batches differ (issue 26: generated mutants of
tasks/sched/bound.py survived on the other tests' workloads, where every batch costs the same).

Batch 0 is calm and the later batches are a wave of hard tasks whose training follows their
length, so each batch has its own step time.
"""

import dataclasses
import random

import pytest

from tasks.sched.bound import estimate
from tasks.sched.workload import Workload

# batches 1, 2, 3 of every 4 are a wave (8x longer rollouts, so 8x the training); batch 0 is not
WAVY = Workload(
    cells=16,
    cap=2,
    batch=8,
    steps=8,
    median_s=100.0,
    sigma=0.5,
    timeout_s=10_000.0,
    burst_every=4,
    burst_len=3,
    burst_factor=8.0,
    train_s_per_sample=10.0,
    train_follows_length=True,
    dp_sync_s=1.0,
)


def test_the_step_time_is_the_first_batchs_whatever_comes_after():
    """``step_s`` is the fastest step on batch 0: a run of batch 0 alone has the same one."""
    alone = dataclasses.replace(WAVY, steps=1)
    assert estimate(WAVY, 1).step_s == estimate(alone, 1).step_s
    calm = dataclasses.replace(WAVY, burst_factor=1.0)  # batch 0 as it was, no wave after
    assert estimate(calm, 1).step_s == estimate(WAVY, 1).step_s


def test_the_steady_rate_is_a_rate_over_the_runs_later_steps():
    for lag in (0, 1, 2):
        b = estimate(WAVY, lag)
        assert 0 < b.steady_per_hour < float("inf")
        assert b.whole_run_per_hour > 0
        # a wave is in its steps: it cannot reach the calm run's steady rate
        calm = estimate(dataclasses.replace(WAVY, burst_factor=1.0), lag)
        assert b.steady_per_hour < calm.steady_per_hour


def _greedy_start(d: list[float], lo: int, mid: int, hi: int, delta: float, slots: int) -> float:
    """Textbook list scheduling in index order: rollout i of [lo, hi] is released at 0 before
    ``mid`` and at ``delta`` from it, starts no earlier than the one before it, on the first
    free of ``slots`` slots; the start of rollout ``hi``."""
    free = [0.0] * slots
    start = 0.0
    for i in range(lo, hi + 1):
        release = delta if i >= mid else 0.0
        j = min(range(slots), key=lambda k: free[k])
        start = max(start, release, free[j])
        free[j] = start + d[i]
    return start


def test_the_slot_wait_releases_rollout_mid_at_delta():
    """``_wait`` (fact 5's slot wait) is greedy list scheduling with ``[mid, hi]`` released
    at ``delta``: rollout ``mid`` itself waits for ``delta``."""
    import numpy as np

    from tasks.sched.bound import _wait

    d = np.array([1.0, 1.0, 1.0])
    assert _wait(d, 0, 1, 2, 10.0, 1) == 11.0  # rollout 1 starts at 10, rollout 2 at 11
    rng = np.random.default_rng(5)
    for _ in range(200):
        slots = int(rng.integers(1, 4))
        hi = int(rng.integers(slots, 9))
        lo = int(rng.integers(0, hi - slots + 1))
        mid = int(rng.integers(lo, hi + 1))
        d = rng.uniform(0.5, 5.0, size=hi + 1)
        delta = float(rng.uniform(0.0, 6.0))
        want = _greedy_start(d.tolist(), lo, mid, hi, delta, slots)
        assert _wait(d, lo, mid, hi, delta, slots) == pytest.approx(want)


def test_prune_keeps_exactly_the_paths_no_other_beats_on_their_tails():
    """The programme's pruning keeps the Pareto front of the last ``hist`` values (smaller is
    better in each), one path per tail, whatever the values before them."""
    from tasks.sched.bound import _prune

    # (0, 9, 1) beats (0, 0, 2) on the last value, though it is larger before it
    assert _prune([(0.0, 0.0, 2.0), (0.0, 9.0, 1.0)], 1) == [(0.0, 9.0, 1.0)]
    rng = random.Random(3)
    for _ in range(200):
        hist = rng.randint(1, 3)
        paths = [
            tuple(float(rng.randint(0, 4)) for _ in range(4)) for _ in range(rng.randint(1, 12))
        ]
        front = {
            p[-hist:]
            for p in paths
            if not any(
                q[-hist:] != p[-hist:]
                and all(a <= x for a, x in zip(q[-hist:], p[-hist:], strict=True))
                for q in paths
            )
        }
        got = _prune(paths, hist)
        assert sorted(p[-hist:] for p in got) == sorted(front)
