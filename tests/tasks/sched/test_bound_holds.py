"""No mode passes the proven bound, on any bench workload, on any seed (tasks/sched/bound.py).

Every mode the simulator has (colocate, async batch and streaming at several
splits, elastic and its ablations) on every file in bench/workloads/, cut to a
pool that runs fast, on seeds 0-2; plus the bursty 128-cell row where the old
bound (now :func:`~tasks.sched.bound.estimate`) was passed by 1.7-4.2 %.
The bound holds per seed, for the realized durations: a run is compared with
its own seed's bound.
"""

import dataclasses
import glob
import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import pytest

from tasks.sched import presets
from tasks.sched.bound import estimate, upper_bound
from tasks.sched.simulator import simulate
from tasks.sched.workload import Workload, load_workload

LAG = 1
SEEDS = (0, 1, 2)


def every_mode(w: Workload, lag: int = LAG) -> list:
    """Each policy the simulator runs, at a few splits; colocate is at lag 0 <= lag."""
    splits = sorted({presets.split_cells(w, f) for f in (0.25, 0.5, 0.75)})
    pols = [presets.colocate(w)]
    for k in splits:
        pols += [presets.async_batch(w, k, lag), presets.async_stream(w, k, lag)]
    pols += [
        presets.elastic(w, lag),
        presets.elastic(w, lag, streaming=False),
        presets.elastic(w, lag, block=2),
    ]
    return pols


def small(path: str, cells: int = 16, steps: int = 8) -> Workload:
    w = load_workload(path)
    if w.cells > cells:  # coarse cells serve 32 sessions: fewer of them
        w = w.resized(max(4, cells * 4 // w.cap) if w.cap > 4 else cells)
    return dataclasses.replace(w, steps=steps)


def bursty_128() -> Workload:
    """The issue's row: reference at 128 cells, sigma 0.3, no growth, training
    0.25x the median rollout over 4 (cap), a 4x wave every 2nd batch."""
    ref = load_workload("bench/workloads/reference.yaml").resized(128)
    return dataclasses.replace(
        ref,
        sigma=0.3,
        growth=1.0,
        train_s_per_sample=0.25 * ref.median_s / ref.cap,
        burst_every=2,
        burst_len=1,
        burst_factor=4.0,
    )


def check(w: Workload, pols: list, seeds=SEEDS, lag: int = LAG) -> list[tuple]:
    """(policy, seed, rate, bound) for every run; asserts the bound's assumptions hold."""
    out = []
    for seed in seeds:
        bound = upper_bound(w, lag, (seed,)).whole_run_per_hour
        for p in pols:
            m = simulate(p, w, seed=seed)
            assert m["steps"] == w.steps, (w.name, p.name, seed)
            # the class the bound is proven for: lag <= L, no session broken
            assert m["lag_max"] <= lag and m["sessions_broken"] == 0, (w.name, p.name, seed)
            out.append((p.name, seed, m["samples_per_hour"], bound))
    return out


def over(rows: list[tuple]) -> list[tuple]:
    return [r for r in rows if r[2] > r[3] * (1 + 1e-9)]


FILES = sorted(glob.glob("bench/workloads/*.yaml"))


def test_there_are_bench_workloads():
    assert len(FILES) >= 10


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.split("/")[-1])
def test_no_mode_passes_the_bound_on_any_bench_workload(path):
    w = small(path)
    rows = check(w, every_mode(w))
    assert not over(rows), over(rows)


def test_no_mode_passes_the_bound_on_the_bursty_128_cell_row():
    """Elastic passed the old bound here by 1.7 %, 2.3 % and 4.2 % on seeds 0-2."""
    w = bursty_128()
    rows = check(w, [presets.elastic(w, LAG)])
    assert not over(rows), over(rows)
    # the estimate is what it says: elastic passes it on every one of these seeds
    est = estimate(w, LAG).whole_run_per_hour
    assert all(rate > est for _, _, rate, _ in rows)


def test_a_bound_per_seed_and_their_median():
    w = small("bench/workloads/bursty.yaml")
    b = upper_bound(w, LAG, SEEDS)
    assert b.proven and len(b.per_seed) == 3
    assert b.whole_run_per_hour == sorted(b.per_seed)[1]
    assert b.per_seed[0] == upper_bound(w, LAG).whole_run_per_hour  # the old call: seed 0
    assert not estimate(w, LAG).proven


BURSTY_128 = "bursty-128"


def _over_at_32_cells(job: tuple[str, int, int]) -> list[tuple]:
    """(workload, lag, seed) -> the runs over the bound: every mode on the bursty row (128
    cells) or a bench file at 32 cells. A module-level function: the slow test runs these
    in a process pool."""
    name, lag, seed = job
    w = bursty_128() if name == BURSTY_128 else small(name, cells=32, steps=12)
    return over(check(w, every_mode(w, lag), seeds=(seed,), lag=lag))


@pytest.mark.slow
@pytest.mark.parametrize("lag", [1, 2])
def test_no_mode_passes_the_bound_at_128_cells(lag):
    """The larger version: every mode on the bursty row and every file at 32 cells.

    Each (workload, seed) is one pure-CPU job, run one per core (the suite itself runs one
    test at a time): the same runs and the same checks as one after another."""
    jobs = [(name, lag, seed) for name in (BURSTY_128, *FILES) for seed in SEEDS]
    n = max(1, min(4, len(os.sched_getaffinity(0))))
    with ProcessPoolExecutor(n, mp_context=get_context("spawn")) as pool:
        for job, rows in zip(jobs, pool.map(_over_at_32_cells, jobs), strict=True):
            assert not rows, (job, rows)
