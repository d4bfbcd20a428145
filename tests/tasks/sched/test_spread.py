"""The executor's costs with their spread (issue 25): finish delays, processing and step
overheads drawn around their means, and a DP regroup paid by a step whose members change.

Live they are not constant, and a lag-gated streaming step waits for the latest finishes,
so the simulator must carry the tail, not only the mean; at spread 0 every figure must be
what it was (the fixed modes' live/sim agreement rests on it).
"""

import dataclasses
import math
import statistics

from tasks.sched import presets
from tasks.sched.simulator import Simulator, simulate
from tasks.sched.workload import Spread, Workload, lognormal_shape

SMALL = Workload(
    name="spread-small",
    cells=8,
    cap=4,
    batch=32,
    steps=8,
    median_s=600.0,
    timeout_s=3600.0,
    growth=2.0,
    train_s_per_sample=30.0,
    dp_sync_s=5.0,
    finish_delay_s=120.0,
    step_overhead_s=60.0,
)


def test_spread_zero_is_the_mean_exactly_and_a_spread_keeps_the_mean():
    assert [Spread(7.5, 0.0, seed=0, stream=1)[i] for i in (0, 5, 10_000)] == [7.5] * 3
    draws = Spread(10.0, 1.0, seed=0, stream=1)
    xs = [draws[i] for i in range(20_000)]
    assert abs(statistics.fmean(xs) - 10.0) < 0.3  # E = mean; sd of the mean ~0.09
    assert draws[3] == Spread(10.0, 1.0, seed=0, stream=1)[3]  # seeded: one per index
    assert draws[3] != Spread(10.0, 1.0, seed=0, stream=2)[3]  # streams independent


def test_lognormal_shape_by_hand():
    """[1, 3]: mean 2, sample variance 2: sqrt(ln(1 + 2 / 4)) = 0.6368."""
    assert math.isclose(lognormal_shape([1.0, 3.0]), math.sqrt(math.log(1.5)))
    assert lognormal_shape([4.0, 4.0, 4.0]) == 0.0
    assert lognormal_shape([5.0]) == 0.0


def test_fixed_modes_unchanged_at_spread_zero():
    """Explicit zeros (and a regroup cost a fixed split never pays: its members stay)
    give every figure of the fixed modes as the workload without the fields."""
    zero = dataclasses.replace(
        SMALL, finish_delay_sigma=0.0, process_s=0.0, process_sigma=0.0, step_overhead_sigma=0.0
    )
    regroup = dataclasses.replace(zero, regroup_s=500.0)
    for pol in (presets.async_stream(SMALL, 5), presets.async_batch(SMALL, 5)):
        base = simulate(pol, SMALL, seed=1)
        assert simulate(pol, zero, seed=1) == base
        assert simulate(pol, regroup, seed=1) == base
        assert base["regroups"] == 0.0
    assert simulate(presets.colocate(SMALL), zero, seed=1) == simulate(
        presets.colocate(SMALL), SMALL, seed=1
    )


def test_processing_adds_to_the_finish_delay():
    """100 s of finish delay + 20 s of processing is 120 s of finish delay, draw for draw
    (both at spread 0)."""
    a = dataclasses.replace(SMALL, finish_delay_s=100.0, process_s=20.0)
    pol = presets.async_stream(SMALL, 5)
    assert simulate(pol, a, seed=2) == simulate(pol, SMALL, seed=2)


def test_regroup_paid_once_per_membership_change():
    """A step over new members costs regroup_s more: elastic's run lasts its regroups x
    regroup_s longer or more (later steps shift), never less."""
    pol = presets.elastic(SMALL, 1)
    base = Simulator(pol, SMALL, seed=0)
    m0 = base.run()
    assert m0["regroups"] >= 1  # elastic changes its members here
    slow = Simulator(pol, dataclasses.replace(SMALL, regroup_s=200.0), seed=0)
    m1 = slow.run()
    assert m1["hours"] > m0["hours"]


def test_spread_hurts_a_lag_gated_elastic_run_at_the_same_mean():
    """The same mean finish delay, spread (sigma 1): the gate waits for the latest
    finishes, so the run is slower; the seeded draws make it the same for every mode."""
    pol = presets.elastic(SMALL, 1)
    flat = simulate(pol, SMALL, seed=0)["samples_per_hour"]
    spread = dataclasses.replace(SMALL, finish_delay_sigma=1.0, step_overhead_sigma=1.0)
    assert simulate(pol, spread, seed=0)["samples_per_hour"] < flat
