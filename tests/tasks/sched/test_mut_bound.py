"""`estimate` on a workload whose batches differ (issue 26: generated mutants of
tasks/sched/bound.py survived on the other tests' workloads, where every batch costs the same).

Batch 0 is calm and the later batches are a wave of hard tasks whose training follows their
length, so each batch has its own step time.
"""

import dataclasses

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
