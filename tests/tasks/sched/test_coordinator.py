"""The three modes and the coordinator on tiny hand-built states (no simulator)."""

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
)
from tasks.sched.modes import Async, Colocate, Elastic
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
    return SchedState(cells=tuple(cells), **base)


def elastic(**kw) -> Elastic:
    args = dict(
        batch=8,
        marks=Marks(low=4, high=16),
        core=2,
        train_s_per_sample=10.0,
        dp_sync_s=1.0,
        min_dwell_s=0.0,
    )
    args.update(kw)
    return Elastic(**args)


# ---- colocate


def test_colocate_cycle_through_the_coordinator():
    co = Coordinator(Colocate(batch=8), n_cells=2, cap=4)
    d = co.handle(Tick(0.0))
    assert d == [StartRollouts(0, 4), StartRollouts(1, 4)]
    assert co.handle(Tick(1.0)) == []  # batch in flight: nothing to do
    for i in range(7):
        co.handle(RolloutFinished(i % 2, i))
    assert co.handle(Tick(2.0)) == []  # one straggler keeps everyone waiting
    co.handle(RolloutFinished(1, 7))
    assert co.handle(Tick(3.0)) == [Move(0, "train"), Move(1, "train")]
    co.handle(MoveDone(0))
    co.handle(MoveDone(1))
    assert co.handle(Tick(4.0)) == [StartStep((0, 1), 8, order="index")]
    co.handle(StepFinished((0, 1)))
    assert co.handle(Tick(5.0)) == [Move(0, "rollout"), Move(1, "rollout")]
    co.handle(MoveDone(0))
    co.handle(MoveDone(1))
    assert co.cell(0).weight_version == 1  # newest weights on the way back
    assert co.handle(Tick(6.0)) == [StartRollouts(0, 4), StartRollouts(1, 4)]


# ---- async


def test_async_fixed_split_and_staleness_gate():
    pol = Async(batch=4, rollout_cells=1)
    assert pol.initial_roles(3) == ("rollout", "train", "train")
    cells = [CellView(0, "rollout"), CellView(1, "train"), CellView(2, "train")]
    # version 0: batches 0 and 1 may start (8 rollouts), no further
    d = pol.recommendations(state(cells, started=4, in_flight=4))
    assert d == [StartRollouts(0, 4)]
    d = pol.recommendations(state(cells, started=8, in_flight=4, cap=8))
    assert d == []  # batch 2 needs version >= 1
    # batch 0 finished -> step 0; the rollout cell must first load v1 to go on
    cells_v = [CellView(0, "rollout", weight_version=0), *cells[1:]]
    d = pol.recommendations(
        state(cells_v, started=8, finished_prefix=4, water_level=4, version=1, trained=4)
    )
    assert LoadWeights(0, 1) in d and not any(isinstance(x, StartRollouts) for x in d)


def test_async_step_waits_for_the_whole_batch():
    pol = Async(batch=4, rollout_cells=1)
    cells = [CellView(0, "rollout", sessions=4), CellView(1, "train")]
    d = pol.recommendations(state(cells, started=8, in_flight=5, water_level=3, finished_prefix=3))
    assert not any(isinstance(x, StartStep) for x in d)
    d = pol.recommendations(state(cells, started=8, in_flight=4, water_level=4, finished_prefix=4))
    assert StartStep((1,), 4, order="index") in d


# ---- elastic


def test_elastic_streaming_step_and_grow_above_high_mark():
    pol = elastic()
    cells = [
        CellView(0, "rollout", sessions=1),  # core
        CellView(1, "rollout", sessions=2),  # core
        CellView(2, "rollout", sessions=3),
        CellView(3, "rollout", sessions=1),
        CellView(4, "train"),
    ]
    d = pol.recommendations(state(cells, water_level=30, finish_rate=0.01))
    assert d[0] == StartStep((4,), 8, order="finish")
    moves = [x for x in d if isinstance(x, Move)]
    # level after the step 22 >= high 16: the fewest-sessions non-core cell leaves,
    # its session rerouted into a free core slot; backpressure: no new rollouts
    assert moves == [Move(3, "train", reroute=((0, 1),))]
    assert not any(isinstance(x, StartRollouts) for x in d)


def test_elastic_core_retention_and_no_move_of_busy_cells():
    pol = elastic(move_step=10)
    cells = [
        CellView(0, "rollout"),
        CellView(1, "rollout"),
        CellView(2, "rollout", busy=True),  # loading weights: sessions paused mid-call
        CellView(3, "train", busy=True),  # inside an optimizer step
    ]
    d = pol.recommendations(state(cells, water_level=100, step_running=True))
    moved = {x.cell for x in d if isinstance(x, Move)}
    assert moved.isdisjoint({0, 1, 2, 3})
    # starved, but the train cell is mid-step: it stays
    d = pol.recommendations(state(cells, water_level=0, step_running=True))
    assert not any(isinstance(x, Move) for x in d)


def test_elastic_rollout_cell_leaves_only_if_its_sessions_can_be_rerouted():
    pol = elastic()
    cells = [
        CellView(0, "rollout", sessions=4),
        CellView(1, "rollout", sessions=3),  # one free core slot
        CellView(2, "rollout", sessions=2),
        CellView(3, "train"),
    ]
    d = pol.recommendations(state(cells, water_level=20, step_running=True))
    assert not any(isinstance(x, Move) for x in d)  # 2 sessions, 1 free slot: wait
    cells[2] = CellView(2, "rollout", sessions=1)
    d = pol.recommendations(state(cells, water_level=20, step_running=True))
    assert d[0] == Move(2, "train", reroute=((1, 1),))


def test_elastic_hysteresis_no_flapping():
    """A level wobbling around the high mark after a grow never sends cells back."""
    pol = elastic()
    cells = [CellView(i, "rollout") for i in range(4)] + [
        CellView(4, "train"),
        CellView(5, "train"),
    ]
    for level in (15, 17, 15, 16, 5, 7):  # inside or above the band, or below it with steps due
        d = pol.recommendations(state(cells, water_level=level, step_running=True))
        assert not any(isinstance(x, Move) and x.to == "rollout" for x in d)
    # only below the low mark with training idle and oversized does a cell go back
    d = pol.recommendations(state(cells, water_level=3))
    assert [x for x in d if isinstance(x, Move)] == [Move(4, "rollout")]


def test_elastic_dwell_time_damps_moves():
    pol = elastic(min_dwell_s=600.0)
    cells = [CellView(0, "rollout"), CellView(1, "rollout"), CellView(2, "rollout", since=9_900.0)]
    cells.append(CellView(3, "train"))
    d = pol.recommendations(state(cells, water_level=20, step_running=True))
    assert not any(isinstance(x, Move) for x in d)  # cell 2 changed role 100 s ago


def test_elastic_refresh_lag_and_moves_in_flight_block_more_moves():
    pol = elastic(refresh_lag=2)
    cells = [
        CellView(0, "rollout", weight_version=1),
        CellView(1, "rollout", weight_version=3),
        CellView(2, "draining", target="train"),
        CellView(3, "rollout"),
        CellView(4, "train"),
    ]
    d = pol.recommendations(state(cells, water_level=20, version=3, step_running=True))
    assert LoadWeights(0, 3) in d and LoadWeights(1, 3) not in d
    assert not any(isinstance(x, Move) for x in d)


def test_coordinator_books_decisions_and_checks_boundaries():
    co = Coordinator(elastic(), n_cells=4, cap=4)
    assert [c.role for c in co.state().cells] == ["rollout"] * 3 + ["train"]
    d = co.handle(Tick(0.0))
    assert sum(x.n for x in d if isinstance(x, StartRollouts)) == 12
    st = co.state()
    assert st.in_flight == 12 and st.started == 12
    with pytest.raises(AssertionError):
        co._book(StartRollouts(0, 1))  # over the concurrency cap
    for i in range(8):
        co.handle(RolloutFinished(i % 3, i))
    d = co.handle(Tick(100.0))
    assert StartStep((3,), 8, order="finish") in d
    assert co.state().water_level == 0 and co.state().step_running
    with pytest.raises(AssertionError, match="boundary"):
        co._book(Move(3, "rollout"))  # a train cell mid-step cannot leave


def test_elastic_waits_for_members_only_while_more_can_join():
    pol = elastic(batch=1000, train_s_per_sample=60.0, dp_sync_s=2.0, min_dwell_s=1e9)
    cells = [CellView(i, "rollout", sessions=4) for i in range(6)] + [CellView(6, "train")]
    # training must grow to keep up (rate 1/s): a lone member does not start the step
    d = pol.recommendations(state(cells, water_level=1000, finish_rate=1.0))
    assert not any(isinstance(x, StartStep) for x in d)
    # nobody can ever join (no non-core rollout cell left): step with what there is
    cells = [CellView(0, "rollout"), CellView(1, "rollout"), CellView(2, "train")]
    d = pol.recommendations(state(cells, water_level=1000, finish_rate=1.0))
    assert StartStep((2,), 1000, order="finish") in d
