"""A healed train cell makes the next step form a new DP generation (infra/cells/healing.py).

The newcomer that takes a lost train cell's place is a fresh process: it holds no process
group, so the next step must rendezvous as a new generation even when the members' cell
ids are the same as before the loss (a restarted worker keeps its cell's name). The
executor's ``_heal`` sets ``dp_left`` for that; a mutant that leaves it unset survived the
fast suite (bench/mutation.py, issue 26).

Unit level: a real ``Executor`` over a small stand-in for the project's own ``Cells`` (its
bookkeeping verbs only: no Dask, no worker) and a ``Work`` whose steps have no members'
jobs; what is under test is the generation the executor gives each step.
"""

from __future__ import annotations

from infra.cells.executor import EngineSpec, Executor
from storage.store import Store
from tasks.sched.coordinator import StartStep

OLD, NEW = "tcp://127.0.0.1:1001", "tcp://127.0.0.1:1002"


class NamedCells:
    """The ``Cells`` verbs ``_heal`` and a step use; every address is cell ``c0`` (a nanny's
    restarted worker keeps its name)."""

    def __init__(self):
        self.roles = {OLD: "idle"}
        self.ran: list = []

    def cell_id(self, address: str) -> str:
        return "c0"

    def rebind(self, old: str, new: str, role: str = "idle") -> None:
        self.roles.pop(old, None)
        self.roles[new] = role

    def run_on(self, address: str, fn, *args, **kwargs):
        self.ran.append((address, getattr(fn, "__name__", fn)))

    def set_role(self, address: str, role: str) -> None:
        self.roles[address] = role

    def workers(self) -> set[str]:
        return set(self.roles)


class NoMembersWork:
    """Steps whose members' jobs the test does not need (none are submitted)."""

    def __init__(self):
        self.plans: list = []

    def step(self, plan):
        self.plans.append(plan)
        return []


def _executor(tmp_path) -> tuple[Executor, NamedCells, NoMembersWork]:
    cells, work = NamedCells(), NoMembersWork()
    ex = Executor(cells, None, Store(str(tmp_path / "store")), "mut", work, EngineSpec("none"))
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
