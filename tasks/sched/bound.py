"""The throughput no scheduler can pass on a workload at a lag bound.

Two limits, each a lower bound on when step ``j`` can start (``S_j``; ``E_j``
its end; ``d`` the fastest DP step, :func:`dp_min`):

- **lag window.** A rollout of base version ``u`` starts after version ``u``
  exists (``E_{u-1}``) and must be trained by step ``u + L``, so
  ``S_{u+L} >= E_{u-1} + (its duration)``. A step trains ``batch`` samples and
  at most ``batch`` rollouts can be in flight per slot-full cluster, so about
  ``batch`` rollouts start per version, and the longest of them is on average
  ``M = E[max of batch durations]`` (the rollout cap once a batch has more
  than a few hundred rollouts). Hence ``S_{u+L} >= S_{u-1} + d + M``:
  ``L + 1`` steps per ``M + d`` at best, i.e. at most
  ``(L + 1) * batch / (M + d)`` samples per second. Base 0 gives
  ``S_L >= M``. Durations are unknown when a rollout starts, so no policy can
  pick which rollouts run long.
- **capacity.** A rollout holds one of ``cap`` slots of a cell for its
  duration and a sample costs ``train_s_per_sample`` cell-seconds to train, so
  by ``S_j`` the ``(j + 1) * batch`` rollouts it needs and ``j`` steps have
  used ``sum E[D_i] / cap + j * batch * t`` cell-seconds of ``cells``.

``S_j`` is at least the largest of ``S_{j-1} + d``, the lag window and the
capacity; the run ends at ``S_{n-1} + d``. Both limits are in expectation
over the duration distribution (a lucky seed can beat them by a little), and
neither counts switching or weight loads, so the bound is not reachable
exactly. Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.sched.waterlevel import best_members, dp_step_seconds
from tasks.sched.workload import Workload, capped_mean, expected_max

_POINTS = 16  # sample points per batch for a batch's mean and longest duration


@dataclass(frozen=True)
class Bound:
    """The bound's figures (rates in samples per hour, times in seconds)."""

    whole_run_per_hour: float
    steady_per_hour: float
    lag_window_per_hour: float  # the lag limit alone, at the run's start
    capacity_per_hour: float  # the capacity limit alone, at the run's start
    step_s: float  # the fastest step
    longest_s: float  # M at the run's start
    run_s: float


def dp_min(w: Workload, s_per_sample: float | None = None) -> float:
    """The fastest step on ``batch`` samples with any number of the cells.

    ``s_per_sample``: a sample's training cost (default ``train_s_per_sample``).
    """
    t = w.train_s_per_sample if s_per_sample is None else s_per_sample
    m = best_members(w.batch, t, w.dp_sync_s, w.cells)
    return dp_step_seconds(w.batch, m, t, w.dp_sync_s)


def _batch_stats(w: Workload, j: int) -> tuple[float, float, float]:
    """Mean duration, expected longest and mean training cost of batch ``j`` (by index)."""
    lo = j * w.batch
    idx = [lo + (w.batch - 1) * k // max(1, _POINTS - 1) for k in range(_POINTS)]
    meds = [w.median_at(i) for i in idx]
    mean = sum(capped_mean(m, w.sigma, w.timeout_s) for m in meds) / len(meds)
    # the smallest median's longest is a lower bound on the batch's longest
    longest = expected_max(min(meds), w.sigma, w.timeout_s, w.batch)
    train = w.train_s_per_sample
    if w.train_follows_length:
        train = sum(w.mean_train_cost(m) for m in meds) / len(meds)
    return mean, longest, train


def upper_bound(w: Workload, max_lag: int) -> Bound:
    """Throughput bound for ``w`` at lag bound ``max_lag`` (see the module text)."""
    if max_lag < 0:
        raise ValueError(f"max_lag must be >= 0, got {max_lag}")
    n, b, L = w.steps, w.batch, max_lag
    stats = [_batch_stats(w, j) for j in range(n)]
    ds = [dp_min(w, st[2]) for st in stats]  # the fastest step on batch j
    d = ds[0]
    starts: list[float] = []
    work = 0.0  # rollout cell-seconds of batches 0..j
    trained = 0.0  # training cell-seconds of batches 0..j-1
    for j in range(n):
        work += b * stats[j][0] / w.cap
        s = starts[-1] + ds[j - 1] if starts else 0.0
        if j == L:
            s = max(s, stats[0][1])
        elif j > L:
            u = j - L
            s = max(s, starts[u - 1] + ds[u - 1] + stats[u][1])
        s = max(s, (work + trained) / w.cells)
        trained += b * stats[j][2]
        starts.append(s)
    run = starts[-1] + ds[-1]
    k = n // 4
    steady = b * (n - 1 - k) / (starts[-1] - starts[k]) * 3600 if n - 1 > k else 0.0
    mean0, longest0, train0 = stats[0]
    return Bound(
        whole_run_per_hour=n * b / run * 3600,
        steady_per_hour=steady,
        lag_window_per_hour=(L + 1) * b / (longest0 + d) * 3600,
        capacity_per_hour=w.cells / (mean0 / w.cap + train0) * 3600,
        step_s=d,
        longest_s=longest0,
        run_s=run,
    )
