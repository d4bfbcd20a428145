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


def _textbook_estimate(w: Workload, lag: int) -> dict[str, float]:
    """The expected-value model as `estimate`'s docstring states it, computed here: per batch
    ``j`` its mean capped duration, its expected longest (of ``batch`` draws at its smallest
    median) and its mean training cost, over 16 evenly spaced rollouts of the batch; ``d_j``
    the fastest step over every member count; ``S_j`` the latest of the previous step's
    end, the lag window (``S_L >= M_0``, ``S_{u+L} >= E_{u-1} + M_u``) and the capacity
    (``cells * S_j >= sum_{u <= j} b * mean_u / cap + sum_{u < j} b * train_u``)."""
    from tasks.sched.waterlevel import dp_step_seconds
    from tasks.sched.workload import capped_mean, expected_max

    n, b = w.steps, w.batch
    mean, longest, train, step = [], [], [], []
    for j in range(n):
        meds = [w.median_at(j * b + (b - 1) * k // 15) for k in range(16)]
        mean.append(sum(capped_mean(m, w.sigma, w.timeout_s) for m in meds) / 16)
        longest.append(expected_max(min(meds), w.sigma, w.timeout_s, b))
        t = sum(w.mean_train_cost(m) for m in meds) / 16
        train.append(t if w.train_follows_length else w.train_s_per_sample)
        step.append(
            min(dp_step_seconds(b, m, train[j], w.dp_sync_s) for m in range(1, w.cells + 1))
        )
    S: list[float] = []
    for j in range(n):
        s = S[j - 1] + step[j - 1] if j else 0.0
        if j == lag:
            s = max(s, longest[0])
        if j > lag:
            u = j - lag
            s = max(s, S[u - 1] + step[u - 1] + longest[u])
        cap = sum(b * mean[u] / w.cap for u in range(j + 1)) + sum(b * train[u] for u in range(j))
        S.append(max(s, cap / w.cells))
    run = S[-1] + step[-1]
    k = n // 4
    return {
        "whole_run_per_hour": n * b / run * 3600,
        "steady_per_hour": b * (n - 1 - k) / (S[-1] - S[k]) * 3600 if n - 1 > k else 0.0,
        "lag_window_per_hour": (lag + 1) * b / (longest[0] + step[0]) * 3600,
        "capacity_per_hour": w.cells / (mean[0] / w.cap + train[0]) * 3600,
        "step_s": step[0],
        "longest_s": longest[0],
        "run_s": run,
    }


@pytest.mark.parametrize(
    "w",
    [
        WAVY,
        dataclasses.replace(WAVY, train_follows_length=False, timeout_s=300.0),
        dataclasses.replace(WAVY, steps=2, cells=3, cap=1, growth=1.5),
        dataclasses.replace(WAVY, steps=1),
        dataclasses.replace(WAVY, batch=40, steps=5, dp_sync_s=0.0, burst_every=0.0),
        # sub-second rollouts and steps on many cells: the first step may start before 1 s
        dataclasses.replace(WAVY, cells=64, median_s=0.01, timeout_s=1.0, train_s_per_sample=0.01),
    ],
    ids=["wavy", "capped", "few-cells", "one-step", "no-sync", "sub-second"],
)
@pytest.mark.parametrize("lag", [0, 1, 3])
def test_the_estimate_is_the_textbook_expected_value_model(w, lag):
    got = estimate(w, lag)
    want = _textbook_estimate(w, lag)
    assert {k: getattr(got, k) for k in want} == pytest.approx(want, rel=1e-12)
    assert got.per_seed == () and got.proven is False


def test_a_negative_lag_is_refused_by_name():
    with pytest.raises(ValueError) as err:
        estimate(WAVY, -1)
    assert str(err.value) == "max_lag must be >= 0, got -1"


@pytest.mark.parametrize("wave", [8.0, 1.0], ids=["wave", "calm"])
@pytest.mark.parametrize("follows", [True, False])
@pytest.mark.parametrize("lag", [0, 1, 2])
def test_a_seeds_realization_is_the_proofs_terms(follows, lag, wave):
    """``_realize``, recomputed from the proof's statements on the seed's durations: the
    rollouts ``0 .. (n + L + 1) * b - 1``; each batch's longest and the last rollout of the
    batch that long (durations capped at the timeout tie); step ``j``'s work lower bound, the
    ``b`` shortest of the rollouts it may train (index in ``[(j - L) b, (j + L + 1) b)``),
    and its fastest step over every member count; the capacity floor (fact 6)."""
    from tasks.sched.bound import _realize
    from tasks.sched.waterlevel import dp_step_seconds
    from tasks.sched.workload import Durations

    # calm: batch 0 is not the shortest, so the capacity floor's choice of rollouts shows
    w = dataclasses.replace(WAVY, timeout_s=150.0, train_follows_length=follows, burst_factor=wave)
    n, b = w.steps, w.batch
    for seed in (0, 1):
        r = _realize(w, lag, seed)
        dur = Durations(w, seed)
        d = [dur[i] for i in range((n + lag + 1) * b)]
        assert list(r.d) == d
        ties = 0
        for k in range(n):
            m = max(d[k * b : (k + 1) * b])
            last = max(i for i in range(k * b, (k + 1) * b) if d[i] == m)
            ties += sum(x == m for x in d[k * b : (k + 1) * b]) > 1
            assert (r.longest[k], r.argmax[k]) == (m, last), k
        assert ties > 0  # the cap makes ties: the last of them is taken
        works = []
        for j in range(n):
            lo, hi = max(0, j - lag) * b, (j + lag + 1) * b
            small = sorted(d[lo:hi])[:b]
            work = w.train_s_per_sample / w.start_mean_s * sum(small) if follows else b * 10.0
            assert r.work[j] == pytest.approx(work, rel=1e-12), j
            fastest = min(
                dp_step_seconds(b, c, work / b, w.dp_sync_s) for c in range(1, w.cells + 1)
            )
            assert r.steps[j] == pytest.approx(fastest, rel=1e-12), j
            sure = max(0, j - lag + 1) * b
            extra = sum(sorted(d[sure:hi])[: (j + 1) * b - sure])
            floor = ((sum(d[:sure]) + extra) / w.cap + sum(works)) / w.cells
            assert r.floor[j] == pytest.approx(floor, rel=1e-12), j
            works.append(work)


def _list_finishes(d, slots: int, b: int = 1, release=()) -> list[float]:
    """Textbook list scheduling: rollouts in index order, each on the first free of ``slots``
    slots (all free at 0), no earlier than the one before it nor its batch's (``i // b``)
    release (0 past the releases given); their finish times."""
    free, start, out = [0.0] * slots, 0.0, []
    for i, di in enumerate(d):
        k = i // b
        j = min(range(slots), key=lambda s: free[s])
        start = max(start, release[k] if k < len(release) else 0.0, free[j])
        free[j] = start + di
        out.append(start + di)
    return out


def test_greedy_finish_is_textbook_list_scheduling_with_batch_releases():
    """``_greedy_finish`` (fact 5's lower bounds): rollouts in index order, each on the first
    free of ``slots`` slots (all free at 0), no earlier than the one before it nor its
    batch's release (none past the releases given); the finish times."""
    import numpy as np

    from tasks.sched.bound import _greedy_finish

    assert list(_greedy_finish(np.array([2.0, 3.0]), 1, 2, [])) == [2.0, 3.0]
    rng = np.random.default_rng(11)
    for _ in range(200):
        b, slots = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        d = rng.uniform(0.1, 5.0, size=int(rng.integers(1, 20)))
        release = sorted(rng.uniform(0, 6, size=int(rng.integers(0, 5))).tolist())
        got = _greedy_finish(d, b, slots, release)
        assert got.tolist() == pytest.approx(
            _list_finishes(d.tolist(), slots, b, release), abs=1e-12
        )


@pytest.mark.parametrize(
    "wave, median, timeout",
    [(8.0, 100.0, 150.0), (1.0, 100.0, 150.0), (1.0, 10.0, 40.0)],
    ids=["wave", "calm", "short"],  # short: the longest under 64 s, a grid under 2 s
)
def test_the_slot_wait_is_the_greedy_start_with_its_delta_rounded_down_to_the_grid(
    wave, median, timeout
):
    """``_SlotWait`` (fact 5 for a batch's longest rollout ``a_beta``): one release back, the
    greedy start of ``a_beta`` from ``a_{beta-1}`` with every slot free; two back, from
    ``a_{beta-2}`` with ``[a_{beta-1}, a_beta]`` released ``delta`` later, ``delta`` rounded
    down to a grid of ``max(1 s, the longest M / 32)`` (so never more than the exact wait,
    and the same for every ``delta`` in one grid cell). The start is recomputed here by
    textbook list scheduling (``_greedy_start`` above)."""
    import math

    from tasks.sched.bound import _realize, _SlotWait

    w = dataclasses.replace(
        WAVY, median_s=median, timeout_s=timeout, burst_factor=wave, cells=2, cap=1
    )
    r = _realize(w, 1, 0)
    slots = w.cells * w.cap
    unit = max(1.0, max(r.longest) / 32)
    assert unit < 2.0 or median == 100.0
    gap = _SlotWait(r, slots)
    d = r.d.tolist()
    a = r.argmax
    for beta in range(2, w.steps):
        assert gap(beta, 1) == _greedy_start(d, a[beta - 1], a[beta - 1], a[beta], 0.0, slots)
        for delta in (0.0, 0.5 * unit, 3.7 * unit, 40.2 * unit):
            down = math.floor(delta / unit) * unit
            want = _greedy_start(d, a[beta - 2], a[beta - 1], a[beta], down, slots)
            assert gap(beta, 2, delta) == pytest.approx(want, abs=1e-9), (beta, delta)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("follows", [True, False])
@pytest.mark.parametrize("wave", [8.0, 1.0], ids=["wave", "calm"])
def test_the_proven_bound_is_exact_where_the_class_has_one_schedule(follows, wave, batch):
    """Lag 0 and a batch no larger than the slots (2 cells of 1): batch ``j`` must be trained
    by step ``j`` and start after step ``j - 1`` ends, each rollout on a slot of its own, so
    every run of the class is batch 0, step 0, batch 1, step 1, ...; the least end is the sum
    of each batch's longest duration and the fastest step on its work, and the proven bound
    must be exactly that run (not a looser figure). (With more rollouts than slots the
    proof's relaxations make it lower than the best run, as it may be.)"""
    from tasks.sched.bound import _realize, upper_bound
    from tasks.sched.waterlevel import dp_step_seconds
    from tasks.sched.workload import Durations

    w = dataclasses.replace(
        WAVY, cells=2, cap=1, batch=batch, steps=6, train_follows_length=follows, burst_factor=wave
    )
    for seed in (0, 3):
        dur = [Durations(w, seed)[i] for i in range(w.steps * batch)]
        r = _realize(w, 0, seed)
        steps = [
            min(dp_step_seconds(batch, c, x / batch, w.dp_sync_s) for c in (1, 2)) for x in r.work
        ]
        run = sum(max(dur[j * batch : (j + 1) * batch]) + steps[j] for j in range(w.steps))
        got = upper_bound(w, 0, seeds=(seed,))
        assert got.run_s == pytest.approx(run, rel=1e-12)
        assert got.per_seed == pytest.approx((w.steps * batch / run * 3600,), rel=1e-12)


@pytest.mark.parametrize("wave", [8.0, 1.0], ids=["wave", "calm"])
@pytest.mark.parametrize("lag", [4, 6])
def test_where_only_slots_bind_the_proven_bound_is_fact_5s(wave, lag):
    """A lag past the run's steps and next to no training: only the slots bind (fact 5). The
    rollouts start in index order on the ``cells * cap`` slots, greedily (textbook list
    scheduling, computed here), the last step cannot start before ``steps * batch`` of them
    have finished and takes its fastest time: the bound is exactly that."""
    from tasks.sched.bound import _realize, upper_bound

    w = dataclasses.replace(
        WAVY,
        cells=2,
        cap=1,
        batch=2,
        steps=4,
        burst_factor=wave,
        train_s_per_sample=1e-3,
        dp_sync_s=0.0,
        train_follows_length=False,
    )
    for seed in (0, 1):
        r = _realize(w, lag, seed)
        last = sorted(_list_finishes(r.d.tolist(), w.cells * w.cap))[w.steps * w.batch - 1]
        # the last step's fastest time: r.steps, checked against every member count above
        assert upper_bound(w, lag, seeds=(seed,)).run_s == pytest.approx(
            last + r.steps[-1], rel=1e-12
        )


@pytest.mark.parametrize("lag", [1, 2])
def test_where_only_the_steps_bind_the_proven_bound_is_back_to_back_steps(lag):
    """Rollouts of about a second and steps of 110 s (fact 1: one step at a time): the first
    step starts once the first batch's rollouts have finished (textbook list scheduling on
    the slots, computed here) and every step runs back to back after it."""
    from tasks.sched.bound import _realize, upper_bound

    w = dataclasses.replace(
        WAVY,
        cells=2,
        cap=1,
        batch=2,
        steps=4,
        median_s=1.0,
        timeout_s=20.0,
        train_s_per_sample=100.0,
        dp_sync_s=5.0,
        train_follows_length=False,
    )
    for seed in (0, 1):
        r = _realize(w, lag, seed)
        assert r.steps == [110.0] * w.steps  # both cells: 2 x 100 / 2 + 2 x 5 s of sync
        first = _list_finishes(r.d[: w.batch].tolist(), w.cells * w.cap)
        want = max(first) + w.steps * 110.0
        assert upper_bound(w, lag, seeds=(seed,)).run_s == pytest.approx(want, rel=1e-12)
