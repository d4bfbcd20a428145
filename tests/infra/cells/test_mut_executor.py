"""The executor's books and its ``cells`` rows, where generated mutants survived the fast
suite (bench/mutation.py, issue 26): the fast tests of infra/cells/executor.py (placement,
pins, role switches on a real cluster) never ran a step, a decided weight load or a lost
cell in the test process, so what those write was pinned by nothing.

What must hold, as a user reads it in the ``cells`` dataset and the run's events:
- a step writes one ``step`` row per member cell (``step N gen G``) and, when it ends, one
  ``step_done`` row per member (``step N -> vN+1``, reason empty, ``seconds`` the step's
  time, the member's own parts: dispatch from the step's start, DP formation, state sync,
  training, rank 0's commit), and ``StepFinished.seconds`` is the time of the step that
  just ended;
- a decided weight load is answered with ``WeightsLoaded`` carrying its measured seconds
  (at least the paced load time) and writes a ``load_weights`` row whose ``load_s`` is the
  load's own time, even on a cell whose engine the executor has not started;
- a move to train writes its ``role`` row with the gateway's withdrawal figures (the
  sessions moved, the KV moved), not the cell's id;
- a lost cell is written as ``lost`` with its worker, and one that no worker replaces
  stops the run naming that worker;
- a group's end and its processing result run on the executor's own named threads.
- (a second sample) a step finished with one result (its commit found after a loss) still
  writes a row per member; finished groups are counted once each; a failed ``cells`` row
  and an event the loop does not know stop the run saying which; a move to rollout writes
  the version it serves and the log says a drain's steps; a rollout row with no engine yet
  has version -1; the timeline's times are the rows' since the run began; a heal asks for a
  look at the workers at once.

Unit level: a real ``Executor`` over a small stand-in for the project's own ``Cells`` (its
verbs only: no Dask worker), a stand-in gateway and a ``Work`` whose jobs are done at once;
the rows are read back from a real store, as SQL reads them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from infra.cells.cluster import ROLES
from infra.cells.executor import EngineSpec, Executor, ExecutorError
from storage.store import Store
from tasks.sched.coordinator import (
    LoadWeights,
    Move,
    MoveDone,
    RolloutFinished,
    StartRollouts,
    StartStep,
    StepFinished,
    WeightsLoaded,
)

BASE = 2000
LOAD_S = 0.05  # the stand-in engine's weight load, seconds


def addr(i: int) -> str:
    return f"tcp://127.0.0.1:{BASE + i}"


class StandInCells:
    """The ``Cells`` verbs the executor uses; ``alive``: the workers the scheduler knows."""

    def __init__(self, n: int):
        self.roles = {addr(i): "idle" for i in range(n)}
        self.alive = set(self.roles)
        self.ran: list[tuple[str, str]] = []

    def cell_id(self, address: str) -> str:
        return f"c{int(address.rsplit(':', 1)[1]) - BASE}"

    def run_on(self, address: str, fn, *args, **kwargs):
        name = getattr(fn, "__name__", str(fn))
        self.ran.append((address, name))
        if name == "start_engine":
            return f"http://{address[6:]}/engine"
        if name == "load_weights":
            time.sleep(LOAD_S)
            return {"success": True}
        return None

    def set_role(self, address: str, role: str) -> None:
        if role not in ROLES:  # as Cells.set_role refuses
            raise ValueError(f"role {role!r}")
        self.roles[address] = role

    def workers(self) -> set[str]:
        return set(self.alive)

    def task_states(self, keys):
        return {}

    def task_state(self, key):
        return "unknown"


class StandInGateway:
    def __init__(self):
        self.calls: list[tuple] = []
        self.withdrawal = {"cell_id": "c0", "sessions_moved": 2, "kv_moves": 1}

    def add_engine(self, cell_id: str, url: str) -> None:
        self.calls.append(("add", cell_id, url))

    def remove_engine(self, cell_id: str, drain_timeout: float, targets: dict) -> dict:
        self.calls.append(("remove", cell_id))
        return dict(self.withdrawal)

    def drop_engine(self, cell_id: str) -> None:
        self.calls.append(("drop", cell_id))

    def end_session(self, session_id: str) -> None:
        self.calls.append(("end", session_id))

    def flush(self) -> None:
        self.calls.append(("flush",))

    def group_sessions(self, group_id: str) -> list:
        return []


class DoneJob:
    """A job that is already done; ``threads`` gets the name of each thread that reads
    its result (``what``: whose result)."""

    def __init__(self, value: Any, what: str, threads: list[tuple[str, str]]):
        self.value, self.what, self.threads = value, what, threads

    def done(self) -> bool:
        return True

    def result(self) -> Any:
        self.threads.append((self.what, threading.current_thread().name))
        return self.value

    def add_done_callback(self, fn) -> None:
        fn()  # as a done future does

    def cancel(self) -> None:
        pass


@dataclass
class Processed:
    samples_segment: str | None = None
    version_min: int = 0


@dataclass
class MemberResult:
    step: int
    weight_version: int
    checkpoint: str = ""
    costs: dict = field(default_factory=dict)


class InstantWork:
    """Rollouts with no sessions, processing with no samples, steps whose members end at
    once at the next version (each plan kept)."""

    def __init__(self):
        self.threads: list[tuple[str, str]] = []
        self.plans: list = []
        self.begin_t: list[float] = []

    def rollout(self, index: int, cell_id: str) -> DoneJob:
        return DoneJob([], "rollout", self.threads)

    def process(self, index, sessions, version, workers=()) -> DoneJob:
        return DoneJob(Processed(), "process", self.threads)

    def step(self, plan) -> list[DoneJob]:
        self.plans.append(plan)
        # the member's own parts (tasks/train_step.py member_step): it starts 0.1 s after
        # the step was submitted
        own = {"begin_t": time.time() + 0.1, "form_s": 0.25, "sync_s": 0.5, "train_s": 1.5}
        rs = [MemberResult(plan.step, plan.version + 1, costs=dict(own)) for _ in plan.members]
        rs[0].costs["commit_s"] = 0.75
        self.begin_t.append(own["begin_t"])
        return [DoneJob(r, "member", self.threads) for r in rs]


@pytest.fixture
def rig(tmp_path):
    cells, gw, work = StandInCells(2), StandInGateway(), InstantWork()
    store = Store(str(tmp_path / "store"))
    ex = Executor(cells, gw, store, "mut", work, EngineSpec("none"), watch_s=0.0, weight_load_s=0.2)
    yield SimpleNamespace(ex=ex, cells=cells, gw=gw, work=work, store=store)
    ex.close()


def until(ex: Executor, want, timeout: float = 60.0) -> list:
    """The executor's events until one satisfies ``want`` (bounded)."""
    seen: list = []
    deadline = time.monotonic() + timeout
    while not any(want(e) for e in seen):
        assert time.monotonic() < deadline, f"timed out after {timeout}s; saw {seen}"
        seen += ex.events(timeout=0.2)
    return seen


def rows(ex: Executor, store: Store, event: str) -> list[dict]:
    assert ex.log.flush(timeout=30)
    return [r for r in store.read("cells").to_pylist() if r["event"] == event]


def test_a_step_writes_its_rows_and_reports_the_time_of_the_step_that_ended(rig):
    ex, work, store = rig.ex, rig.work, rig.store
    ex.start(("rollout", "train"), "test")
    finished = []
    for step in range(3):
        ex.apply(StartRollouts(0, 1), "test")
        until(ex, lambda e: isinstance(e, RolloutFinished))
        ex.apply(StartStep((1,), 1), "test")
        time.sleep(0.05 * (3 - step))  # the steps' times differ: the first is the longest
        finished += [
            e
            for e in until(ex, lambda e: isinstance(e, StepFinished))
            if isinstance(e, StepFinished)
        ]
    assert ex.version == 3 and [p.step for p in work.plans] == [0, 1, 2]
    started = rows(ex, store, "step")
    assert {r["role"] for r in started} == {"train"}  # the timeline's step bars read it
    assert [(r["cell_id"], r["detail"]) for r in started] == [
        ("c1", "step 0 gen 0"),
        ("c1", "step 1 gen 0"),
        ("c1", "step 2 gen 0"),
    ]
    done = rows(ex, store, "step_done")
    assert [(r["cell_id"], r["detail"], r["reason"]) for r in done] == [
        ("c1", "step 0 -> v1", ""),
        ("c1", "step 1 -> v2", ""),
        ("c1", "step 2 -> v3", ""),
    ]
    assert [e.cells for e in finished] == [(1,)] * 3
    # each member's own parts of the step, in its row: dispatch from the step's start
    for r, st, begin in zip(done, started, work.begin_t, strict=True):
        assert 0.1 <= r["dispatch_s"] <= begin - st["t"] + 1e-3, (r, st["t"], begin)
        parts = (r["form_s"], r["sync_s"], r["train_s"], r["commit_s"])
        assert parts == (0.25, 0.5, 1.5, 0.75), r
    # each event's seconds is its own step's (the row's), not another step's
    assert [e.seconds for e in finished] == pytest.approx([r["seconds"] for r in done], abs=1e-3)
    assert finished[0].seconds != pytest.approx(finished[2].seconds, abs=1e-3)


def test_a_decided_load_reports_its_seconds_and_writes_its_own_load_time(rig):
    ex, cells, store = rig.ex, rig.cells, rig.store
    ex.start(("train", "train"), "test")  # no engine started on any cell yet
    t0 = time.monotonic()
    ex.apply(LoadWeights(0, 0), "test")
    seen = until(ex, lambda e: isinstance(e, WeightsLoaded))
    took = time.monotonic() - t0
    (loaded,) = [e for e in seen if isinstance(e, WeightsLoaded)]
    assert (loaded.cell, loaded.version) == (0, 0)
    assert loaded.seconds is not None and 0.2 <= loaded.seconds <= took + 0.05  # paced 0.2 s
    assert (addr(0), "load_weights") in cells.ran
    (row,) = rows(ex, store, "load_weights")
    assert (row["cell_id"], row["role"], row["detail"]) == ("c0", "rollout", "v0")
    assert LOAD_S <= row["load_s"] < 1.0, row  # the load's own time, nothing added
    assert row["seconds"] >= 0.2


def test_a_move_to_train_writes_the_withdrawal_figures_not_the_cell_id(rig):
    ex, cells, gw, store = rig.ex, rig.cells, rig.gw, rig.store
    ex.start(("rollout", "rollout"), "test")
    ex.apply(Move(0, "train"), "test: recruit")
    until(ex, lambda e: isinstance(e, MoveDone))
    assert ex.roles[0] == "train" and cells.roles[addr(0)] == "train"
    assert ("remove", "c0") in gw.calls
    (row,) = [r for r in rows(ex, store, "role") if r["role"] == "train"]
    assert row["detail"] == "sessions_moved=2, kv_moves=1"
    assert row["reason"] == "test: recruit"


def test_a_lost_cell_is_written_and_one_never_replaced_stops_the_run_naming_its_worker(tmp_path):
    cells, gw, work = StandInCells(2), StandInGateway(), InstantWork()
    store = Store(str(tmp_path / "store"))
    ex = Executor(
        cells, gw, store, "mut", work, EngineSpec("none"), watch_s=0.0, heal_timeout_s=0.3
    )
    try:
        ex.start(("rollout", "train"), "test")
        cells.alive.discard(addr(1))
        with pytest.raises(ExecutorError, match=r"cell 1 \(worker tcp://127\.0\.0\.1:2001\)"):
            until(ex, lambda e: False, timeout=30)
        assert ex.stats.cells_lost == 1
        (row,) = rows(ex, store, "lost")
        assert (row["cell_id"], row["role"], row["detail"]) == ("c1", "train", f"worker {addr(1)}")
    finally:
        ex.close()


def test_a_groups_end_and_its_processing_result_run_on_the_executors_named_threads(rig):
    ex, work = rig.ex, rig.work
    ex.start(("rollout", "train"), "test")
    ex.apply(StartRollouts(0, 2), "test")
    seen = until(ex, lambda e: isinstance(e, RolloutFinished))
    if sum(isinstance(e, RolloutFinished) for e in seen) < 2:
        until(ex, lambda e: isinstance(e, RolloutFinished))
    names = {(what, name.rsplit("_", 1)[0]) for what, name in work.threads}
    assert names == {("rollout", "gyre-exec-end"), ("process", "gyre-exec-result")}, names


# -- the second sample's survivors (bench/mutation.py on the source of stop 36) ----------


class HeldJob(DoneJob):
    """A member job that never ends by itself (a step that a loss interrupted)."""

    def done(self) -> bool:
        return False

    def add_done_callback(self, fn) -> None:
        pass


class HeldStepWork(InstantWork):
    def step(self, plan) -> list[DoneJob]:
        self.plans.append(plan)
        return [HeldJob(None, "member", self.threads) for _ in plan.members]


def test_a_step_finished_with_one_result_writes_a_row_for_every_member(tmp_path):
    """A step whose commit was found after a member's loss finishes with the committed
    record alone (``Healing._retry``: one result for all its members): every member still
    gets its ``step_done`` row, and the step is reported with all its cells."""
    cells, gw, work = StandInCells(3), StandInGateway(), HeldStepWork()
    ex = Executor(cells, gw, Store(str(tmp_path / "s")), "mut", work, EngineSpec("none"))
    try:
        ex.start(("rollout", "train", "train"), "test")
        ex.apply(StartRollouts(0, 1), "test")
        until(ex, lambda e: isinstance(e, RolloutFinished))
        ex.apply(StartStep((1, 2), 1), "test")
        assert [p.members for p in work.plans] and ex.events(timeout=0.1) == []  # held
        out = ex._finish_step([MemberResult(0, 1, checkpoint="v1")])  # the committed record
        assert out == [StepFinished((1, 2), seconds=out[0].seconds)] and ex.version == 1
        done = rows(ex, ex.store, "step_done")
        assert [(r["cell_id"], r["detail"]) for r in done] == [
            ("c1", "step 0 -> v1"),
            ("c2", "step 0 -> v1"),
        ]
    finally:
        ex.close()


def test_finished_groups_are_counted_once_each(rig):
    ex = rig.ex
    ex.start(("rollout", "train"), "test")
    ex.apply(StartRollouts(0, 3), "test")
    seen: list = []
    while sum(isinstance(e, RolloutFinished) for e in seen) < 3:
        seen += until(ex, lambda e: isinstance(e, RolloutFinished))
    assert (ex.stats.groups_started, ex.stats.groups_done) == (3, 3)


def test_a_failed_cells_row_stops_the_run_saying_what_failed(rig):
    ex = rig.ex
    ex.start(("rollout", "train"), "test")
    ex.log.on_error(OSError("disk full"))  # as the cells log calls it when an append fails
    with pytest.raises(ExecutorError, match=r"^cells row failed: disk full$"):
        until(ex, lambda e: False, timeout=10)


def test_an_event_the_loop_does_not_know_is_named_in_its_error(rig):
    ex = rig.ex
    ex._q.put(("bogus", 7))
    with pytest.raises(ExecutorError, match=r"unknown executor event \('bogus', 7\)"):
        until(ex, lambda e: False, timeout=10)


def test_a_move_to_rollout_writes_the_version_it_serves(rig, caplog):
    ex, store = rig.ex, rig.store
    ex.start(("train", "train"), "test")
    ex.apply(Move(1, "rollout"), "test: lend")
    until(ex, lambda e: isinstance(e, MoveDone))
    (row,) = [r for r in rows(ex, store, "role") if r["role"] == "rollout"]
    assert (row["cell_id"], row["detail"], row["reason"]) == ("c1", "serving v0", "test: lend")
    assert row["weight_version"] == 0  # its engine's, once loaded
    # the move's measured costs: from the decision, paced by the weight load (0.2 s)
    assert row["wait_s"] is not None and 0.0 <= row["wait_s"] <= row["seconds"], row
    assert row["seconds"] >= 0.2, row
    with caplog.at_level("INFO", logger="infra.cells.executor"):
        ex.apply(Move(1, "train"), "test: recruit")
        until(ex, lambda e: isinstance(e, MoveDone))
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("cell c1 draining (") for m in said), said
    assert any(m.startswith("cell c1 withdrawn: ") for m in said), said


def test_a_rollout_row_before_any_engine_says_its_version_is_unknown(rig):
    ex, store = rig.ex, rig.store
    ex.start(("train", "train"), "test")
    ex.apply(LoadWeights(0, 0), "test")
    until(ex, lambda e: isinstance(e, WeightsLoaded))
    (decide,) = rows(ex, store, "decide")
    assert (decide["role"], decide["weight_version"]) == ("rollout", -1)  # no engine yet
    (loaded,) = rows(ex, store, "load_weights")
    assert loaded["weight_version"] == 0
    assert {r["weight_version"] for r in rows(ex, store, "join")} == {0}  # train: the run's


def test_the_timeline_holds_each_rows_time_since_the_run_began(rig):
    ex, store = rig.ex, rig.store
    ex.start(("rollout", "train"), "test")
    time.sleep(0.3)
    ex.apply(Move(0, "train"), "test")
    until(ex, lambda e: isinstance(e, MoveDone))
    written = store.read("cells").to_pylist() if ex.log.flush(timeout=30) else []
    assert [(e["cell"], e["event"]) for e in ex.timeline] == [
        (int(r["cell_id"][1:]), r["event"]) for r in written
    ]
    for e, r in zip(ex.timeline, written, strict=True):
        assert e["t"] == pytest.approx(r["t"] - ex.t0, abs=1e-3)
    assert ex.timeline[-1]["t"] >= 0.3


class BlockedPreload(StandInCells):
    """A replacement worker whose imports wait for ``go``; it answers the verbs a heal uses."""

    def __init__(self, n: int):
        super().__init__(n)
        self.go = threading.Event()
        self.looks = 0

    def run_on(self, address: str, fn, *args, **kwargs):
        if getattr(fn, "__name__", "") == "preloaded":
            assert self.go.wait(30)
            return None
        return super().run_on(address, fn, *args, **kwargs)

    def rebind(self, old: str, new: str, role: str = "idle") -> None:
        self.roles.pop(old, None)
        self.roles[new] = role

    def workers(self) -> set[str]:
        self.looks += 1
        return super().workers()


def test_a_healed_cell_is_looked_at_at_once_not_at_the_next_tick(tmp_path):
    """A heal asks for a look at the workers now (an aborted step is retried on it, a late
    task is seen), however long the loop's look interval."""
    cells, gw, work = BlockedPreload(2), StandInGateway(), InstantWork()
    ex = Executor(
        cells, gw, Store(str(tmp_path / "s")), "mut", work, EngineSpec("none"), watch_s=0.0
    )
    try:
        ex.start(("rollout", "train"), "test")
        cells.alive.discard(addr(1))
        cells.alive.add(addr(5))  # a new worker takes its place
        cells.roles[addr(5)] = "idle"
        deadline = time.monotonic() + 30
        while ex.stats.cells_lost == 0 or not ex._pool._work_queue.empty():
            assert time.monotonic() < deadline
            ex.events(timeout=0.1)
        ex.watch_s = 3600.0  # from now on, only a forced look
        time.sleep(0.3)
        ex.events(timeout=0.1)  # an answer under way comes in
        before = cells.looks
        cells.go.set()
        deadline = time.monotonic() + 30
        while ex.stats.cells_healed == 0:
            assert time.monotonic() < deadline
            ex.events(timeout=0.1)
        deadline = time.monotonic() + 10
        while cells.looks == before:
            assert time.monotonic() < deadline, "no look after the heal"
            ex.events(timeout=0.1)
        assert ex.stats.cells_healed == 1
    finally:
        cells.go.set()
        ex.close()
