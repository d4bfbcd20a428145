"""Each scheduling mode configured for a workload, the same way for bench and tests.

Everything a policy is told comes from what a real run knows before it starts:
batch, lag bound, rollout cap (``timeout_s``), cost of a training sample and of
DP sync, cost of a role switch and a weight load, the call interval. No mode is
told rollout durations.

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import dataclasses

from tasks.sched.modes import Async, AsyncStream, Colocate, Elastic, core_cells
from tasks.sched.waterlevel import Marks
from tasks.sched.workload import Workload

CORE_FRAC = 0.125
PILOT_STEPS = 16  # see pilot


def elastic_marks(w: Workload) -> Marks:
    """Marks on the time to the next step (seconds).

    ``low``: what a rollout cell needs to join training (its sessions' next
    call boundary, the switch, one tick). ``high``: ``low`` plus a round trip
    (out: switch + weight load; back: call + switch): an idle train cell is
    lent to rollout only if it can go and be back before the next step needs
    it. The gap between the marks, one round trip, is the dead band.
    """
    low = w.call_s + w.switch_s + w.tick_s
    trip = (w.switch_s + w.weight_load_s) + (w.call_s + w.switch_s)
    return Marks(low=low, high=low + trip)


def colocate(w: Workload) -> Colocate:
    return Colocate(batch=w.batch, train_s_per_sample=w.train_s_per_sample, dp_sync_s=w.dp_sync_s)


def async_batch(w: Workload, rollout_cells: int, max_lag: int = 1) -> Async:
    return Async(
        batch=w.batch,
        rollout_cells=rollout_cells,
        max_lag=max_lag,
        train_s_per_sample=w.train_s_per_sample,
        dp_sync_s=w.dp_sync_s,
    )


def async_stream(w: Workload, rollout_cells: int, max_lag: int = 1) -> AsyncStream:
    return AsyncStream(
        batch=w.batch,
        rollout_cells=rollout_cells,
        max_lag=max_lag,
        train_s_per_sample=w.train_s_per_sample,
        dp_sync_s=w.dp_sync_s,
    )


def elastic(w: Workload, max_lag: int = 1, **overrides) -> Elastic:
    args = dict(
        batch=w.batch,
        core=core_cells(w.cells, CORE_FRAC),
        train_s_per_sample=w.train_s_per_sample,
        dp_sync_s=w.dp_sync_s,
        timeout_s=w.timeout_s,
        marks=elastic_marks(w),
        max_lag=max_lag,
    )
    args.update(overrides)
    return Elastic(**args)


def split_cells(w: Workload, frac: float) -> int:
    """Rollout cells of a fixed split at rollout fraction ``frac`` (1 .. cells-1)."""
    return max(1, min(w.cells - 1, round(frac * w.cells)))


def pilot(w: Workload) -> Workload:
    """The run a user makes before picking a fixed split: the workload's first hour
    (``Workload.frozen_at_start``: no growth, no wave seen yet) for ``PILOT_STEPS`` steps,
    whatever the length of the run under test. One rule for bench/sched.py and
    bench/modes.py: a pilot at the run's own step count let the advance split depend on it
    (3 and 8 steps picked different splits of the same file)."""
    return dataclasses.replace(w.frozen_at_start(), steps=PILOT_STEPS)
