"""Healing's bookkeeping (infra/cells/healing.py), where generated mutants survived the fast
suite (bench/mutation.py, issue 26):

- A healed train cell makes the next step form a new DP generation: the newcomer is a
  fresh process that holds no process group, even when the members' cell ids are the same
  as before the loss (a restarted worker keeps its cell's name). ``_heal`` sets
  ``dp_left`` for that (the mutant leaving it unset survived).
- A healed rollout cell holds ``loading`` while its engine starts and loads the newest
  weights, then serves and takes ``rollout`` (mutants of the ``loading`` role survived).
- A lost cell gives the running rollout and processing groups a fresh deadline (a mutant
  setting it to ``None`` survived).

Unit level: a real ``Executor`` over a small stand-in for the project's own ``Cells`` (its
bookkeeping verbs only: no Dask, no worker), a stand-in gateway and a ``Work`` whose steps
have no members' jobs; what is under test is what the executor books.
"""

from __future__ import annotations

import time

from infra.cells.cluster import ROLES
from infra.cells.executor import EngineSpec, Executor, Group
from storage.store import Store
from tasks.sched.coordinator import StartStep

OLD, NEW = "tcp://127.0.0.1:1001", "tcp://127.0.0.1:1002"


class NamedCells:
    """The ``Cells`` verbs ``_heal``, a step and a rollout cell's engine use; every address
    is cell ``c0`` (a nanny's restarted worker keeps its name). ``ran``: each function run on
    a cell, with the cell's role at that moment."""

    def __init__(self):
        self.roles = {OLD: "idle"}
        self.ran: list[tuple[str, str, str]] = []

    def cell_id(self, address: str) -> str:
        return "c0"

    def rebind(self, old: str, new: str, role: str = "idle") -> None:
        self.roles.pop(old, None)
        self.roles[new] = role

    def run_on(self, address: str, fn, *args, **kwargs):
        name = getattr(fn, "__name__", str(fn))
        self.ran.append((address, name, self.roles[address]))
        if name == "start_engine":
            return "http://127.0.0.1:9/engine"
        if name == "load_weights":
            return {"success": True}
        return None

    def set_role(self, address: str, role: str) -> None:
        if role not in ROLES:  # as Cells.set_role refuses
            raise ValueError(f"role {role!r}")
        assert address in self.roles, f"no cell at {address}"
        self.roles[address] = role

    def workers(self) -> set[str]:
        return set(self.roles)


class Gateway:
    """The gateway verbs the executor uses on a cell's engine."""

    def __init__(self):
        self.calls: list[tuple] = []

    def add_engine(self, cell_id: str, url: str) -> None:
        self.calls.append(("add", cell_id, url))

    def drop_engine(self, cell_id: str) -> None:
        self.calls.append(("drop", cell_id))


class NoMembersWork:
    """Steps whose members' jobs the test does not need (none are submitted)."""

    def __init__(self):
        self.plans: list = []

    def step(self, plan):
        self.plans.append(plan)
        return []


def _executor(tmp_path) -> tuple[Executor, NamedCells, NoMembersWork]:
    cells, work = NamedCells(), NoMembersWork()
    ex = Executor(cells, Gateway(), Store(str(tmp_path / "store")), "mut", work, EngineSpec("none"))
    ex.roles[0] = "train"
    return ex, cells, work


def _heal_cell_0(ex: Executor) -> None:
    """Cell 0's worker was lost and ``NEW`` took its place (what ``_observe`` books)."""
    ex.lost_addr[0] = OLD
    ex.membership.lost_since[0] = 0.0
    ex.membership.retired.add(OLD)
    ex.addrs[0] = NEW  # the membership shares ``addrs``
    ex.membership.healing.add(0)
    ex._heal(0, NEW)


def test_a_healed_train_cell_makes_the_next_step_a_new_generation(tmp_path):
    ex, cells, work = _executor(tmp_path)
    try:
        ex._start_step(StartStep((0,), 0), "test")
        ex._start_step(StartStep((0,), 0), "test: same members, same group")
        assert [p.generation for p in work.plans] == [0, 0]
        _heal_cell_0(ex)
        assert not ex.membership.is_lost(0) and cells.roles[NEW] == "train"
        ex._start_step(StartStep((0,), 0), "test: after the heal")
        gens = [p.generation for p in work.plans]
        assert work.plans[-1].members == work.plans[0].members == ("c0",)
        assert gens == [0, 0, 1], f"the healed newcomer must start a new DP generation: {gens}"
        assert work.plans[-1].workers == (NEW,)
        ex._start_step(StartStep((0,), 0), "test: the group is formed")
        assert work.plans[-1].generation == 1
    finally:
        ex.close()


def test_a_healed_rollout_cell_starts_its_engine_while_loading_then_serves(tmp_path):
    """A healed rollout cell holds the ``loading`` role (no rollout slot: no task lands on
    it) while its engine starts and loads the newest weights; then it is routed to and
    takes ``rollout`` again."""
    ex, cells, _work = _executor(tmp_path)
    try:
        ex.roles[0] = "rollout"
        ex.version = 3
        _heal_cell_0(ex)
        on_new = [(fn, role) for addr, fn, role in cells.ran if addr == NEW]
        assert ("start_engine", "loading") in on_new, on_new
        assert ("load_weights", "loading") in on_new, on_new
        assert cells.roles == {NEW: "rollout"}
        assert ex.engine_version[0] == 3 and 0 in ex.routed
        assert ex.gateway.calls[-1] == ("add", "c0", "http://127.0.0.1:9/engine")
        assert not ex.membership.is_lost(0) and not ex.dp_left
    finally:
        ex.close()


def test_a_lost_cell_gives_the_running_groups_a_fresh_deadline(tmp_path):
    """Dask reruns a lost cell's rollout and processing tasks elsewhere: their deadline
    starts again from the loss (a buffered group has none to extend); the gateway stops
    routing to the lost engine."""
    ex, _cells, _work = _executor(tmp_path)
    try:
        soon = time.monotonic() + 1.0
        ex.groups = {
            0: Group(0, 0, 0.0, phase="rollout", deadline=soon),
            1: Group(1, 0, 0.0, phase="process", deadline=soon),
            2: Group(2, 0, 0.0, phase="buffered", deadline=soon),
        }
        t0 = time.monotonic()
        ex._on_lost(0, OLD)
        for g in (0, 1):
            assert ex.groups[g].deadline >= t0 + ex.job_timeout_s, ex.groups[g]
        assert ex.groups[2].deadline == soon
        assert ex.gateway.calls == [("drop", "c0")]
        assert ex.lost_addr == {0: OLD} and ex.stats.cells_lost == 1
    finally:
        ex.close()
