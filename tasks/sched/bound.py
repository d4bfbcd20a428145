"""The throughput no scheduler can pass on a workload at a lag bound -- and an estimate.

Two figures, each reported as what it is:

- :func:`upper_bound` is **proven** for the realized rollout durations of the
  seeds it is given: no run of any scheduler of the class below, on those
  seeds, trains faster (tested on every mode and every bench workload,
  tests/tasks/sched/test_bound_holds.py).
- :func:`estimate` is the earlier model: the same two limits in expectation
  over the duration distribution, with batch ``u`` (by index) taken as the
  rollouts of base ``u``. It is usually close to what the best schedulers
  reach, but it is **not** a bound: on a bursty workload (128 cells, sigma
  0.3, a 4x wave every 2nd batch) elastic passes it by 1.7-4.2 % on seeds
  0-2, because a seed's longest rollouts are not the expected ones and a
  policy may start a batch up to ``L`` versions early (admission lets
  ``(v + L + 1) * batch`` rollouts start by version ``v``), so batch ``u`` is
  not the set of base-``u`` rollouts.

**The class of schedulers** (what the simulator enforces, plus one rule every
gyre mode keeps): rollouts start in index order and hold one of ``C = cells *
cap`` slots until they finish (pauses only delay them; no session is broken);
steps run one at a time (step ``j`` starts from weights ``j`` at ``S_j`` and
ends at ``E_j``, ``E_{-1} = 0``), a step on ``b`` samples of work ``W`` takes
at least the fastest DP time :func:`dp_min`; every trained token has lag
``<= L``; and **nothing is wasted**: every rollout started is trained, unless
its lag allowance runs past the run's last step (the admission and gate rules
of tasks/sched/lag.py guarantee it).

**The proof.** Let ``v'_i`` be the newest version when rollout ``i`` starts
(its base is at most that). Facts, for a run of that class:

1. ``S_j >= E_{j-1}`` and ``E_j >= S_j + d_j``, ``d_j`` the fastest step on a
   lower bound of step ``j``'s work.
2. *No batch runs late.* Steps ``0..v`` trained ``(v + 1) * b`` rollouts, all
   started before ``E_v``; starts are in index order, so every rollout of
   index ``< (v + 1) * b`` started before ``E_v``: ``v'_i <= beta_i`` for
   ``i`` in batch ``beta_i`` (by index).
3. *No batch runs early.* A rollout started before ``E_{v-1}`` has base
   ``<= v - 1`` and must be trained by step ``v - 1 + L``, i.e. among the
   first ``(v + L) * b`` samples (nothing wasted); so at most ``(v + L) * b``
   rollouts start before ``E_{v-1}``: ``v'_i >= beta_i - L``.
4. *The lag window.* Rollout ``i`` starts at or after ``E_{v'_i - 1}`` and,
   its base being ``<= v'_i``, is trained by step ``v'_i + L``:
   ``S_{v'_i + L} >= E_{v'_i - 1} + d_i``. ``v'`` does not decrease with ``i``.
5. *Slots.* At most ``C - 1`` rollouts are in flight when one starts. If
   rollouts ``a .. i-1`` all started at or after ``E_x``, rollout ``i``
   cannot start before ``E_x`` plus the ``C``-th largest of their durations.
   Greedy list scheduling in index order with each batch released at a
   lower bound of ``E_{beta - L - 1}`` (fact 3) starts every rollout no
   later than any run does (induction on the index), so its finish times
   ``phi_i`` are lower bounds: ``S_j`` is at least the ``(j + 1) * b``-th
   smallest ``phi_i``, and at least the ``b``-th smallest of
   ``max(phi_i, E_{j-L-1} + d_i)`` over the rollouts step ``j`` may train.
6. *Capacity.* By ``S_j`` the rollouts of batches ``<= j - L`` (fact 2 and 3:
   all of them are trained by step ``j``) and ``L * b`` more of index
   ``< (j + L + 1) * b`` have held slots for their durations and steps
   ``0..j-1`` have used their work: ``cells * S_j >= sum d / cap + sum W``.

Fact 4 is a choice per rollout; applied to each batch's longest rollout
``a_beta`` (``d = M_beta``; the last one on a tie) it says: some window ``v``
in ``[beta - L, beta]`` has ``S_{v+L} >= E_{v-1} + M_beta``, with the windows
of successive batches in order; the rollouts of batch ``beta`` up to
``a_beta`` are trained by step ``v + L`` too. Fact 5 adds the wait for a slot:
the rollouts from ``a_{beta-2}`` on start after their batches' windows open,
so ``a_beta`` starts no earlier than greedy list scheduling of them from those
releases says (:class:`_SlotWait`). The bound is the least
``E_{n-1}`` over every such choice of windows: a dynamic programme over the
steps whose state is the last few ``S`` values and the windows of the last two
batches (states no better in every value are dropped; where too many remain,
neighbours are merged into their componentwise minimum, which can only lower
the result, so it stays a bound). Fact 5's release times come from the
programme's own least ``E`` per step, refined over a few passes.

A bound per seed has to allow a scheduler that knows the seed's durations
(one that starts each batch's longest rollout where a window is long): no
online policy can, so the gyre modes reach ~0.65-0.78 of it on the bench rows
(32 cells), where they reach 0.83-1.04 of :func:`estimate`.

Not counted (so the bound is not reachable exactly): switching, weight loads,
the cells a step holds while rollouts run, which rollouts a step may take
beyond the above. Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import heapq
import math
import statistics
from dataclasses import dataclass

import numpy as np

from tasks.sched.waterlevel import best_members, dp_step_seconds
from tasks.sched.workload import Durations, Workload, capped_mean, expected_max

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
    per_seed: tuple[float, ...] = ()  # whole-run bound of each seed (proven only)
    proven: bool = False  # True: upper_bound (no run passes it); False: estimate


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


def estimate(w: Workload, max_lag: int) -> Bound:
    """The expected-value model of the bound: an estimate, **not** a bound.

    Two limits on when step ``j`` can start (``d_j`` the fastest step on batch
    ``j``'s expected work):

    - lag window: batch ``u`` (by index) is taken as the rollouts of base
      ``u``; they start after ``E_{u-1}`` and are trained by step ``u + L``,
      so ``S_{u+L} >= S_{u-1} + d + M_u`` with ``M_u`` the expected longest of
      ``batch`` durations (the rollout cap once a batch has a few hundred);
      base 0 gives ``S_L >= M_0``.
    - capacity: by ``S_j`` the ``(j + 1) * batch`` rollouts and ``j`` steps
      have used ``sum E[D_i] / cap + sum W`` cell-seconds of ``cells``.

    Both are in expectation and the first assumes no batch starts early, so a
    seed's run can pass it (see the module text); :func:`upper_bound` cannot be.
    """
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


# ---- the proven bound, on a seed's realized durations --------------------------------

_FRONT = 48  # most states kept per discrete state of the programme (more are merged)
_PASSES = 3  # rounds of release times for the greedy start bounds (fact 5)


@dataclass(frozen=True)
class _Seed:
    """One seed's realized workload, in the terms of the proof."""

    d: np.ndarray  # durations of rollouts 0 .. (n + L + 1) * b - 1
    longest: list[float]  # M_beta
    argmax: list[int]  # a_beta (absolute index)
    work: list[float]  # lower bound of step j's training work (cell-s)
    steps: list[float]  # d_j: the fastest step on that work
    floor: list[float]  # capacity (fact 6) and the step's own b shortest (fact 4)


def _fastest(w: Workload, work: float) -> float:
    return dp_min(w, work / w.batch)


def _realize(w: Workload, L: int, seed: int) -> _Seed:
    n, b = w.steps, w.batch
    dur = Durations(w, seed)
    d = np.array([dur[i] for i in range((n + L + 1) * b)])
    # each batch's longest rollout, the last of them on a tie (the cap): the most
    # rollouts before it, so facts 5's prefix and slot wait say the most
    argmax = [(k + 1) * b - 1 - int(np.argmax(d[k * b : (k + 1) * b][::-1])) for k in range(n)]
    work: list[float] = []
    floor: list[float] = []
    for j in range(n):
        # step j trains b rollouts of base >= j - L: index >= (j - L) * b (fact 3's
        # count) and < (j + L + 1) * b (started before E_j, fact 3 at v = j + 1)
        lo, hi = max(0, j - L) * b, (j + L + 1) * b
        small = np.partition(d[lo:hi], b - 1)[:b]
        if w.train_follows_length:
            work.append(w.train_s_per_sample / w.start_mean_s * float(small.sum()))
        else:
            work.append(b * w.train_s_per_sample)
        # capacity: batches <= j - L in full, the L * b shortest of the rest up to hi
        sure = max(0, j - L + 1) * b
        more = (j + 1) * b - sure
        extra = float(np.partition(d[sure:hi], more - 1)[:more].sum())
        floor.append(((float(d[:sure].sum()) + extra) / w.cap + sum(work[:j])) / w.cells)
    return _Seed(
        d=d,
        longest=[float(d[a]) for a in argmax],
        argmax=argmax,
        work=work,
        steps=[_fastest(w, x) for x in work],
        floor=floor,
    )


def _greedy_finish(d: np.ndarray, b: int, slots: int, release: list[float]) -> np.ndarray:
    """Finish times of greedy list scheduling in index order (fact 5's lower bounds)."""
    free = [0.0] * slots  # a heap of the times slots come free
    g = np.empty(len(d))
    last = 0.0
    for i, di in enumerate(d.tolist()):
        k = i // b
        last = max(last, release[k] if k < len(release) else 0.0, free[0])
        heapq.heapreplace(free, last + di)
        g[i] = last
    return g + d


class _SlotWait:
    """Fact 5 for a batch's longest rollout ``a_beta``: the earliest it can start.

    Rollouts ``[a_{beta-2}, a_{beta-1})`` start at or after one release,
    ``[a_{beta-1}, a_beta]`` at or after a second ``delta`` later (their
    windows' ``E``); every slot is free at the first (a relaxation) and they
    start in index order. Greedy list scheduling gives the earliest start of
    ``a_beta`` relative to the first release; it does not decrease with
    ``delta``, so ``delta`` is rounded down to a grid and the result cached.
    """

    def __init__(self, r: _Seed, slots: int) -> None:
        self.r, self.slots = r, slots
        self.unit = max(1.0, max(r.longest) / 32)
        self._cache: dict[tuple[int, int, int], float] = {}

    def __call__(self, beta: int, back: int, delta: float = 0.0) -> float:
        k = int(delta // self.unit) if back == 2 else 0
        key = (beta, back, k)
        if key not in self._cache:
            a = self.r.argmax
            lo, mid = a[beta - back], a[beta - 1]
            self._cache[key] = _wait(self.r.d, lo, mid, a[beta], k * self.unit, self.slots)
        return self._cache[key]


def _wait(d: np.ndarray, lo: int, mid: int, hi: int, delta: float, slots: int) -> float:
    """Greedy start of rollout ``hi``: ``[lo, mid)`` released at 0, ``[mid, hi]`` at ``delta``."""
    if hi - lo < slots:
        return delta if mid < hi or lo == mid else 0.0
    free = [0.0] * slots
    last = 0.0
    for i, di in enumerate(d[lo:hi].tolist(), start=lo):
        last = max(last, delta if i >= mid else 0.0, free[0])
        heapq.heapreplace(free, last + di)
    return max(last, delta, free[0])


def _proven(w: Workload, L: int, seed: int) -> tuple[float, list[float], _Seed]:
    """Least ``E_{n-1}`` over every run of the class (module text) and its ``S``."""
    n, b, slots = w.steps, w.batch, w.cells * w.cap
    r = _realize(w, L, seed)
    need = max(0, n - L)  # batches 0 .. need-1 are trained in full
    hist = 2 * L + 4  # S values a transition reads back (window of batch beta - 2)
    gap = _SlotWait(r, slots)
    least = [0.0] * n
    best: tuple[float, tuple[float, ...]] = (math.inf, ())
    for _ in range(_PASSES):
        ends = [least[k] + r.steps[k] for k in range(n)]
        release = [ends[k - L - 1] if k - L - 1 >= 0 and k <= n else 0.0 for k in range(n + L + 1)]
        phi = _greedy_finish(r.d, b, slots, release)
        # a batch's rollouts up to its longest are trained by its window's step v + L
        done = [float(phi[k * b : r.argmax[k] + 1].max()) for k in range(n)]
        base = []
        for j in range(n):
            lo, hi = max(0, j - L) * b, (j + L + 1) * b
            t = ends[j - L - 1] if j - L - 1 >= 0 else 0.0
            own = np.maximum(phi[lo:hi], t + r.d[lo:hi])
            fin = float(np.partition(phi[:hi], (j + 1) * b - 1)[(j + 1) * b - 1])
            late = float(phi[(j - L) * b : (j - L + 1) * b].max()) if 0 <= j - L < need else 0.0
            base.append(max(r.floor[j], fin, late, float(np.partition(own, b - 1)[b - 1])))
        best, got = _programme(r, L, need, hist, gap, done, base)
        least = [max(a, x) for a, x in zip(least, got, strict=True)]
    return best[0] + r.steps[-1], list(best[1]), r


def _programme(r: _Seed, L: int, need: int, hist: int, gap, done, base):
    """The dynamic programme over window choices (module text); best path and least S_k."""
    n = len(r.steps)

    def end(path: tuple[float, ...], x: int) -> float:  # E_x on a path
        return path[x] + r.steps[x] if x >= 0 else 0.0

    # key: (first unassigned batch, ((batch, window) of the last two assigned)); value: paths
    fronts: dict[tuple, list[tuple[float, ...]]] = {(0, ()): [()]}
    least: list[float] = []
    for k in range(n):
        v = k - L  # the window closing at step k: S_{v+L} >= E_{v-1} + ...
        new: dict[tuple, list[tuple[float, ...]]] = {}
        for (p, last), paths in fronts.items():
            for path in paths:
                s0 = max(base[k], path[-1] + r.steps[k - 1] if path else 0.0)
                if v < 0:
                    new.setdefault((p, last), []).append((*path, s0))
                    continue
                lo_q = max(p, min(v + 1, need))  # batch beta's last window is beta
                hi_q = max(lo_q, min(k + 1, need))  # and its first beta - L
                s, prev = s0, last
                for q in range(p, hi_q + 1):
                    if q > p:  # batch q - 1's longest rollout goes to window v
                        beta = q - 1
                        s = max(s, end(path, v - 1) + r.longest[beta], done[beta])
                        if prev and prev[-1][0] == beta - 1:  # fact 5: wait for a slot
                            e1 = end(path, prev[-1][1] - 1)
                            s = max(s, e1 + gap(beta, 1) + r.longest[beta])
                            if len(prev) == 2 and prev[0][0] == beta - 2:
                                e2 = end(path, prev[0][1] - 1)
                                s = max(s, e2 + gap(beta, 2, e1 - e2) + r.longest[beta])
                        prev = (*prev, (beta, v))[-2:]
                    if q >= lo_q:
                        new.setdefault((q, prev), []).append((*path, s))
        fronts = {key: _prune(paths, hist) for key, paths in new.items()}
        least.append(min(path[-1] for paths in fronts.values() for path in paths))
    finals = [path for (p, _), paths in fronts.items() if p >= need for path in paths]
    top = min(finals, key=lambda path: path[-1])
    return (top[-1], top), least


def _prune(paths: list[tuple[float, ...]], hist: int) -> list[tuple[float, ...]]:
    """Drop paths no better in any of the last ``hist`` values; merge past ``_FRONT``."""
    paths = sorted(set(paths), key=lambda p: p[-hist:])
    keep: list[tuple[float, ...]] = []
    for p in paths:
        tail = p[-hist:]
        if not any(all(a <= x for a, x in zip(o[-hist:], tail, strict=True)) for o in keep):
            keep.append(p)
    while len(keep) > _FRONT:  # componentwise minimum of neighbours: a relaxation
        keep.sort(key=lambda p: p[-1])
        merged = [
            tuple(min(a, x) for a, x in zip(keep[i], keep[i + 1], strict=True))
            for i in range(0, len(keep) - 1, 2)
        ]
        keep = merged + keep[len(merged) * 2 :]
    return keep


def upper_bound(w: Workload, max_lag: int, seeds: tuple[int, ...] | list[int] = (0,)) -> Bound:
    """The proven throughput bound for ``w`` at lag ``max_lag`` on ``seeds`` (module text).

    No run of a scheduler of the class in the module text on seed ``s`` trains
    faster than that seed's bound (``per_seed``); ``whole_run_per_hour`` is
    their median, so the median of the runs' rates over ``seeds`` cannot pass
    it either. The other figures are of the median seed; ``steady_per_hour`` is
    the programme's best path's steady rate, informative, not itself a bound.
    """
    if max_lag < 0:
        raise ValueError(f"max_lag must be >= 0, got {max_lag}")
    n, b, L = w.steps, w.batch, max_lag
    per = []
    for seed in seeds:
        run_s, path, r = _proven(w, L, seed)
        per.append((n * b / run_s * 3600, run_s, path, r))
    rates = sorted(x[0] for x in per)
    mid = sorted(per, key=lambda x: x[0])[len(per) // 2]
    rate, run_s, path, r = mid
    k = n // 4
    steady = (
        b * (n - 1 - k) / (path[-1] - path[k]) * 3600 if n - 1 > k and path[-1] > path[k] else rate
    )
    return Bound(
        whole_run_per_hour=statistics.median(rates),
        steady_per_hour=steady,
        lag_window_per_hour=(L + 1) * b / (r.longest[0] + r.steps[0]) * 3600,
        capacity_per_hour=w.cells / (float(r.d[:b].mean()) / w.cap + r.work[0] / b) * 3600,
        step_s=r.steps[0],
        longest_s=r.longest[0],
        run_s=run_s,
        per_seed=tuple(x[0] for x in per),
        proven=True,
    )
