"""The modes and the coordinator on tiny hand-built states (no simulator)."""

import pytest

from tasks.sched.coordinator import (
    CellView,
    Coordinator,
    LoadWeights,
    Move,
    MoveDone,
    RolloutFinished,
    SchedState,
    StartRollouts,
    StartStep,
    StepFinished,
    Tick,
    VersionCount,
    WeightsLoaded,
)
from tasks.sched.costs import Costs
from tasks.sched.modes import Async, AsyncStream, Colocate, Elastic
from tasks.sched.waterlevel import Marks


def state(cells, **kw) -> SchedState:
    base = dict(
        now=10_000.0,
        cap=4,
        water_level=0,
        in_flight=0,
        started=0,
        trained=0,
        finished_prefix=0,
        version=0,
        step_running=False,
        finish_rate=0.0,
    )
    base.update(kw)
    vs = base.get("versions", ())
    base.setdefault("in_flight", sum(v.in_flight for v in vs))
    return SchedState(cells=tuple(cells), **base)


def elastic(**kw) -> Elastic:
    args = dict(
        batch=8,
        core=2,
        train_s_per_sample=10.0,
        dp_sync_s=1.0,
        timeout_s=3_600.0,
        marks=Marks(low=100.0, high=1_000.0),
        max_lag=1,
        min_dwell_s=0.0,
    )
    args.update(kw)
    return Elastic(**args)


# ---- colocate


def test_colocate_cycle_through_the_coordinator():
    co = Coordinator(Colocate(batch=8, train_s_per_sample=10.0, dp_sync_s=1.0), n_cells=2, cap=4)
    d = co.handle(Tick(0.0))
    assert d == [StartRollouts(0, 4), StartRollouts(1, 4)]
    assert co.handle(Tick(1.0)) == []  # batch in flight: nothing to do
    for i in range(7):
        co.handle(RolloutFinished(i % 2, i))
    assert co.handle(Tick(2.0)) == []  # one straggler keeps everyone waiting
    co.handle(RolloutFinished(1, 7))
    # the fastest DP size for 8 samples x 10 s with 1 s sync per member is 2 (of 2)
    assert co.handle(Tick(3.0)) == [Move(0, "train"), Move(1, "train")]
    co.handle(MoveDone(0))
    co.handle(MoveDone(1))
    (step,) = co.handle(Tick(4.0))
    assert step == StartStep((0, 1), 8, order="index", rollouts=tuple(range(8)))
    co.handle(StepFinished((0, 1)))
    assert co.handle(Tick(5.0)) == [Move(0, "rollout"), Move(1, "rollout")]
    co.handle(MoveDone(0))
    co.handle(MoveDone(1))
    assert co.cell(0).weight_version == 1  # newest weights on the way back
    assert co.handle(Tick(6.0)) == [StartRollouts(0, 4), StartRollouts(1, 4)]


# ---- async (batch and streaming)


def test_async_fixed_split_and_lag_gate():
    pol = Async(batch=4, rollout_cells=1, max_lag=1)
    assert pol.initial_roles(3) == ("rollout", "train", "train")
    cells = [CellView(0, "rollout"), CellView(1, "train"), CellView(2, "train")]
    # version 0: batches 0 and 1 may start (8 rollouts), no further
    assert pol.recommendations(state(cells, started=4, in_flight=4)) == [StartRollouts(0, 4)]
    assert pol.recommendations(state(cells, started=8, in_flight=4, cap=8)) == []
    # lag <= 2: batch 2 may start with version 0 too
    pol2 = Async(batch=4, rollout_cells=1, max_lag=2)
    assert pol2.recommendations(state(cells, started=8, in_flight=4, cap=8)) == [
        StartRollouts(0, 4)
    ]
    # batch 0 trained -> v1; the stale rollout cell loads v1 before it starts more
    cells_v = [CellView(0, "rollout", weight_version=0), *cells[1:]]
    d = pol.recommendations(state(cells_v, started=8, finished_prefix=4, version=1, trained=4))
    assert d == [LoadWeights(0, 1)]


def test_async_step_waits_for_the_whole_batch():
    pol = Async(batch=4, rollout_cells=1, train_s_per_sample=10.0, dp_sync_s=1.0)
    cells = [CellView(0, "rollout", sessions=4), CellView(1, "train")]
    d = pol.recommendations(state(cells, started=8, in_flight=5, water_level=3, finished_prefix=3))
    assert not any(isinstance(x, StartStep) for x in d)
    d = pol.recommendations(state(cells, started=8, in_flight=4, water_level=4, finished_prefix=4))
    assert StartStep((1,), 4, order="index") in d


def test_async_stream_takes_oldest_and_respects_the_gate():
    pol = AsyncStream(batch=4, rollout_cells=1, max_lag=1, train_s_per_sample=10.0, dp_sync_s=1.0)
    cells = [CellView(0, "rollout", sessions=4, weight_version=2), CellView(1, "train")]
    blocked = [VersionCount(1, 1, 2, oldest_start=0.0), VersionCount(2, 3, 5)]
    d = pol.recommendations(state(cells, version=2, started=16, versions=blocked))
    assert not any(isinstance(x, StartStep) for x in d)  # a base-1 rollout still runs
    ok = [VersionCount(1, 0, 2), VersionCount(2, 4, 5)]
    d = pol.recommendations(state(cells, version=2, started=16, versions=ok))
    assert d == [StartStep((1,), 4, order="oldest")]


# ---- elastic


def test_elastic_step_waits_for_the_lag_gate_then_takes_the_fastest_members():
    pol = elastic()
    cells = [CellView(i, "rollout", weight_version=3) for i in range(2)]
    cells += [CellView(i, "train", weight_version=3) for i in range(2, 6)]
    gate_shut = [VersionCount(2, 1, 9, oldest_start=9_000.0), VersionCount(3, 0, 6)]
    d = pol.recommendations(state(cells, version=3, started=40, versions=gate_shut))
    assert not any(isinstance(x, StartStep) for x in d)
    open_ = [VersionCount(2, 0, 9), VersionCount(3, 1, 6)]
    d = pol.recommendations(state(cells, version=3, started=40, versions=open_))
    # best DP size for 8 samples x 10 s, 1 s sync: sqrt(80) ~ 9 -> all 4 train cells
    assert d[0] == StartStep((2, 3, 4, 5), 8, order="oldest")


def test_elastic_recruits_when_the_step_is_near_rerouting_to_new_enough_weights():
    pol = elastic(core=2, trip_in_sizing=False)  # wants every cell (sizing: tests below)
    cells = [
        CellView(0, "rollout", sessions=1, weight_version=2),  # core, old weights
        CellView(1, "rollout", sessions=2, weight_version=3),  # core, 2 free slots
        CellView(2, "rollout", sessions=1, weight_version=3),
        CellView(3, "rollout", sessions=0, weight_version=3),
        CellView(4, "rollout", sessions=4, weight_version=3),
    ]
    # the gate opens within marks.low: the base-2 rollout started 3,550 s ago (cap 3,600)
    vs = [VersionCount(2, 1, 8, oldest_start=10_000.0 - 3_550.0), VersionCount(3, 8, 0)]
    d = pol.recommendations(state(cells, version=3, started=40, versions=vs))
    moves = [x for x in d if isinstance(x, Move)]
    # emptiest first: cell 3 (no sessions), then cell 2 whose session goes to cell 1
    # (cell 0 holds older weights); cell 4's four sessions do not fit anywhere
    assert moves == [Move(3, "train"), Move(2, "train", reroute=((1, 1),))]


def test_elastic_lends_idle_trainers_only_when_the_next_step_is_far():
    pol = elastic(core=1)
    cells = [CellView(0, "rollout", sessions=4, weight_version=5)]
    cells += [CellView(i, "train", weight_version=5) for i in range(1, 5)]
    # just published v5: (5 + 2) x 8 - 48 = 8 rollouts may start, no slot free;
    # the next gate ~1 h away: two idle train cells go (4 slots each)
    far = [VersionCount(4, 2, 0, oldest_start=10_000.0)]
    d = pol.recommendations(state(cells, version=5, started=48, versions=far, published_at=9_990.0))
    assert [x for x in d if isinstance(x, Move)] == [Move(1, "rollout"), Move(2, "rollout")]
    # inside the dead band (gate in 500 s: between low 100 and high 1,000): nothing moves
    mid = [VersionCount(4, 2, 8, oldest_start=10_000.0 - 3_100.0)]  # water holds a batch
    d = pol.recommendations(state(cells, version=5, started=48, versions=mid))
    assert not any(isinstance(x, Move) for x in d)


def test_elastic_backpressure_only_core_takes_sessions_while_training_waits():
    pol = elastic(core=1)
    cells = [
        CellView(0, "rollout", sessions=2, weight_version=3),
        CellView(1, "rollout", sessions=4, weight_version=3),
        CellView(2, "rollout", sessions=3, weight_version=3),
    ]
    vs = [VersionCount(2, 0, 8), VersionCount(3, 9, 0)]  # gate open, nobody trains
    d = pol.recommendations(state(cells, version=3, started=32, versions=vs))
    starts = [x for x in d if isinstance(x, StartRollouts)]
    # no cell can leave yet (their sessions do not fit); cells 1 and 2 are left to
    # empty out, the core takes the new rollouts
    assert not any(isinstance(x, Move) for x in d)
    assert starts == [StartRollouts(0, 2)]


def test_elastic_core_and_busy_cells_never_move():
    pol = elastic(core=2)
    cells = [
        CellView(0, "rollout"),
        CellView(1, "rollout"),
        CellView(2, "rollout", busy=True),  # loading weights: its sessions are paused
        CellView(3, "train", busy=True),  # inside an optimizer step
    ]
    vs = [VersionCount(0, 0, 30)]
    d = pol.recommendations(state(cells, versions=vs, step_running=True))
    assert {x.cell for x in d if isinstance(x, Move)}.isdisjoint({0, 1, 2, 3})


def test_elastic_blocks_move_together():
    pol = elastic(core=1, block=2)
    cells = [CellView(0, "rollout", sessions=4, weight_version=3)]
    cells += [CellView(i, "rollout", sessions=0, weight_version=3) for i in (1, 2)]
    cells += [CellView(3, "rollout", sessions=4, weight_version=3)]
    cells += [CellView(4, "rollout", sessions=0, weight_version=3)]
    vs = [VersionCount(2, 0, 8), VersionCount(3, 8, 0)]
    d = pol.recommendations(state(cells, version=3, started=32, versions=vs))
    # block {1, 2} goes; block {3, 4} cannot (cell 3's sessions would need cell 4's slots)
    assert [x.cell for x in d if isinstance(x, Move)] == [1, 2]


# ---- the coordinator


def test_coordinator_books_versions_and_names_the_rollouts_a_step_trains():
    co = Coordinator(AsyncStream(batch=2, rollout_cells=2, max_lag=1), n_cells=3, cap=2)
    d = co.handle(Tick(0.0))
    assert d == [StartRollouts(0, 2), StartRollouts(1, 2)]  # 2 x batch at version 0
    co.handle(RolloutFinished(1, 3))
    co.handle(RolloutFinished(0, 1, version=0))
    st = co.state()
    assert st.versions == (VersionCount(0, 2, 2, oldest_start=0.0),)
    (step,) = co.handle(Tick(10.0))
    assert step.rollouts == (3, 1)  # oldest base first, then in finish order
    assert co.state().versions == (VersionCount(0, 2, 0, oldest_start=0.0),)
    co.handle(StepFinished((2,)))
    co.handle(Tick(20.0))
    assert co.state().published_at == 20.0 or co.state().version == 1


def test_coordinator_keeps_the_reported_oldest_version():
    co = Coordinator(AsyncStream(batch=1, rollout_cells=1, max_lag=3), n_cells=2, cap=4)
    co.handle(Tick(0.0))
    co._cells[0].weight_version = 2  # (as if loaded) later rollouts book base 2
    co.handle(RolloutFinished(0, 0, version=0))
    assert [(v.version, v.finished) for v in co.state().versions] == [(0, 1)]


def test_coordinator_checks_boundaries_and_caps():
    co = Coordinator(elastic(), n_cells=4, cap=4)
    assert [c.role for c in co.state().cells] == ["rollout"] * 4
    d = co.handle(Tick(0.0))
    assert sum(x.n for x in d if isinstance(x, StartRollouts)) == 16  # (0 + 1 + 1) x 8
    with pytest.raises(AssertionError, match="cap"):
        co._book(StartRollouts(0, 1))
    with pytest.raises(AssertionError, match="reroute"):
        co._book(Move(3, "train", reroute=((0, 1),)))  # 4 sessions, 1 rerouted
    co.handle(Tick(1.0))
    co._book(LoadWeights(3, 0))
    with pytest.raises(AssertionError, match="boundary"):
        co._book(Move(3, "train"))  # busy: mid weight load
    co.handle(WeightsLoaded(3, 0))


def test_elastic_training_size_fastest_when_lag_bound_binds_else_by_capacity():
    """1,000 cells, batch 4,000, 60 s/sample, 2 s sync: the fastest step has 346
    members. Lag <= 1 with a 4 h cap: two steps per (14,400 s + d), so every
    second of d counts: 346. Lag <= 4 with 5,000 s rollouts: per step the pool
    needs (4,000 x 5,000 / 4 + 240,000 + 2 m^2) / 1,000 = 5,240 + 0.002 m^2 s
    and the lag window far less, so capacity binds from m = 47 (where
    d(m) = 240,000 / m + 2 m drops to it); past that the largest m within 2 %
    of 5,244.4 s: 0.002 m^2 <= 109.3 -> m = 233. (Round trips not counted.)
    """
    cells = [CellView(i, "rollout") for i in range(1000)]
    kw = dict(train_s_per_sample=60.0, dp_sync_s=2.0, timeout_s=14_400.0, batch=4000, core=125)
    kw["trip_in_sizing"] = False
    s = state(cells, mean_duration=5_000.0)
    assert elastic(**kw, max_lag=1)._target_members(s) == 346
    assert elastic(**kw, max_lag=4)._target_members(s) == 233
    assert elastic(**kw, max_lag=4)._target_members(state(cells)) == 346  # no duration yet


def test_elastic_training_size_pays_for_round_trips():
    """The same pool, each member's round trip 900 s (the marks' dead band; no move
    measured yet) once per L + 1 steps. Lag <= 1: per step the lag window costs the
    pool (14,400 + 240,000 / m + 2 m) / 2 s and the trips 900 m / 2 cell-s, i.e.
    0.45 m s of the pool's time: minimal at m = sqrt(120,000 / 1.45) ~ 288 (not 346).
    Lag <= 4: capacity (5,240 + 0.002 m^2 + 0.18 m) binds; within 2 % of its best,
    m = 201. A measured round trip replaces the guess: 90 s, under 5 % of the 4 h cap,
    is not worth counting (late starts that short do not show at the gate): 346 again.
    """
    cells = [CellView(i, "rollout") for i in range(1000)]
    kw = dict(train_s_per_sample=60.0, dp_sync_s=2.0, timeout_s=14_400.0, batch=4000, core=125)
    s = state(cells, mean_duration=5_000.0)
    assert elastic(**kw, max_lag=1)._target_members(s) == 288
    assert elastic(**kw, max_lag=4)._target_members(s) == 201
    measured = Costs(60.0, 2.0, drain_s=60.0, to_rollout_s=30.0)
    s = state(cells, mean_duration=5_000.0, costs=measured)
    assert elastic(**kw, max_lag=1)._target_members(s) == 346


def test_coordinator_longest_duration_over_the_window():
    """One slot: rollouts of 500, 100 and 100 s one after another; the longest of the
    last two is 100 once the 500 s one has left the window."""
    co = Coordinator(AsyncStream(batch=2, rollout_cells=1, max_lag=1), 2, 1, duration_window=2)
    co.handle(Tick(0.0))
    for i, t in enumerate((500.0, 600.0, 700.0)):
        co.handle(Tick(t))
        co.handle(RolloutFinished(0, i))
        co.handle(Tick(t))  # the next rollout starts at t
        if i == 1:
            assert co.state().longest_duration == 500.0
    assert co.state().longest_duration == 100.0


def test_coordinator_mean_duration_over_finishes():
    co = Coordinator(AsyncStream(batch=2, rollout_cells=1, max_lag=1), n_cells=2, cap=4)
    co.handle(Tick(0.0))  # starts rollouts 0-3 at t = 0
    co.handle(Tick(100.0))
    co.handle(RolloutFinished(0, 0))
    co.handle(Tick(300.0))
    co.handle(RolloutFinished(0, 1))
    assert co.state().mean_duration == pytest.approx(200.0)  # (100 + 300) / 2
    assert co.duration_window == 2 * 2 * 4  # two pools' worth of slots


def test_elastic_tries_a_second_dp_size_the_cheap_way():
    """While every measured step had one size (``Costs.sizes``), a ready step is staffed
    one size off, so the cost fit can tell per-sample from per-member cost. Which way: up
    while a round trip is cheap (20 s here, under 5 % of the 1 h cap: a recruit costs
    little), down where it is counted in sizing (1,200 s: one larger would recruit a cell
    for a whole trip; one smaller costs only a slower step); never below 1 member or past
    the non-core cells; once two sizes are measured, the size stands."""
    cells = [CellView(i, "rollout") for i in range(8)]  # core 2: at most 6 members
    pol = elastic(trip_in_sizing=True)

    def tried(m, sizes, drain, back):
        costs = Costs(10.0, 1.0, drain_s=drain, to_rollout_s=back, sizes=sizes)
        return pol._explore(state(cells, costs=costs), m)

    assert tried(3, (3,), 10.0, 10.0) == 4
    assert tried(3, (3,), 600.0, 600.0) == 2
    assert tried(1, (1,), 600.0, 600.0) == 2  # cannot go down
    assert tried(6, (6,), 10.0, 10.0) == 5  # cannot go up
    assert tried(3, (3, 5), 600.0, 600.0) == 3
    assert elastic(explore=False)._explore(state(cells, costs=Costs(10.0, 1.0, sizes=(3,))), 3) == 3
