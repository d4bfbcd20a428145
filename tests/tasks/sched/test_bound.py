"""The upper bound by hand, and no mode passes it (tasks/sched/bound.py)."""

import dataclasses
import itertools
import math

import pytest

from tasks.sched import presets
from tasks.sched.bound import dp_min, estimate, upper_bound
from tasks.sched.simulator import simulate
from tasks.sched.workload import Workload


def test_issue_figure_reference_size_lag_one():
    """1,000 cells, batch 4,000, 4 h cap, lag <= 1: about 1,824 samples/h.

    By hand: the fastest step uses m = sqrt(4000 * 60 / 2) ~ 346 members,
    d = 2 * sqrt(4000 * 60 * 2) = 1,385.6 s; the longest of 4,000 rollouts is
    the 4 h cap; two steps per (14,400 + 1,385.6) s.
    """
    w = Workload(cells=1000, cap=4, batch=4000, steps=48, median_s=1800.0)
    d = 2 * math.sqrt(4000 * 60 * 2)
    assert dp_min(w) == pytest.approx(d, rel=1e-3)
    b = estimate(w, 1)
    assert b.lag_window_per_hour == pytest.approx(2 * 4000 / (14400 + d) * 3600, rel=1e-3)
    assert b.lag_window_per_hour == pytest.approx(1824.4, abs=0.5)
    # 48 steps: S_1 >= 4 h, then pairs of steps every 14,400 + d, the last ends d later
    run = 14400 + 23 * (14400 + d) + d
    assert b.whole_run_per_hour == pytest.approx(48 * 4000 / run * 3600, rel=1e-3)
    assert estimate(w, 0).lag_window_per_hour == pytest.approx(4000 / (14400 + d) * 3600, rel=1e-3)


def test_capacity_limits_when_the_lag_window_does_not():
    # deterministic 100 s rollouts, 2 cells x 1 slot, 10 s/sample training, batch 4
    w = Workload(
        cells=2,
        cap=1,
        batch=4,
        steps=10,
        median_s=100.0,
        sigma=0.0,
        timeout_s=1e6,
        train_s_per_sample=10.0,
        dp_sync_s=0.0,
    )
    b = upper_bound(w, 3)
    # capacity: 2 cells / (100 + 10) cell-s per sample
    assert b.capacity_per_hour == pytest.approx(2 / 110 * 3600)
    assert b.whole_run_per_hour <= b.capacity_per_hour + 1e-9
    assert b.lag_window_per_hour == pytest.approx(4 * 4 / (100 + 20) * 3600)  # d = 40/2


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_no_mode_passes_the_bound_on_deterministic_durations(lag):
    """With sigma 0 the bound holds for every run, not only on average."""
    w = Workload(
        cells=8,
        cap=2,
        batch=16,
        steps=8,
        median_s=1200.0,
        sigma=0.0,
        timeout_s=7200.0,
        tick_s=10.0,
    )
    bound = upper_bound(w, lag).whole_run_per_hour
    pols = [
        presets.elastic(w, lag),
        presets.async_stream(w, 6, lag),
        presets.async_batch(w, 6, lag),
    ]
    if lag == 0:
        pols.append(presets.colocate(w))
    for p in pols:
        m = simulate(p, w, seed=0)
        assert m["lag_max"] <= lag, p.name
        assert m["samples_per_hour"] <= bound * (1 + 1e-9), (p.name, m["samples_per_hour"], bound)


def test_bound_grows_with_the_lag_and_never_beats_capacity():
    w = Workload(cells=64, batch=256, steps=24)
    rates = [estimate(w, L).whole_run_per_hour for L in range(6)]
    assert all(a < b for a, b in itertools.pairwise(rates[:4]))  # the lag window binds
    cap = estimate(w, 0).capacity_per_hour
    assert rates[4] == rates[5] <= cap  # from lag 4 on, capacity does
    big = estimate(dataclasses.replace(w, steps=200), 50)
    assert big.steady_per_hour <= cap * 1.001
