"""The look at the cluster's workers runs off the scheduling loop (infra/cells/healing.py,
issue 25): a round trip to the scheduler was 15-35 ms on a loaded host, several a second,
5-32 s of a run's loop time when the loop made it itself.

- While a look is under way, the loop's ``events`` returns (it never waits for the
  scheduler), and no second look is started beside it.
- Its answer comes back as an event: a cell missing from it is lost.
- A forced look asked for during one under way (a cell healed) is made once that one is
  answered.
- The no-worker check holds a group only to the task it asked about: a group that moved on
  (its rollout ended, its processing started) meanwhile is not counted as waiting.

A real ``Executor`` over the stand-in cells of test_mut_healing (no Dask): what is under
test is the executor's loop, not the cluster.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from infra.cells.executor import EngineSpec, Executor, Group
from storage.store import Store
from tests.infra.cells.test_mut_healing import OLD, Gateway, NamedCells, NoMembersWork


class HeldCells(NamedCells):
    """``workers`` blocks until ``release`` is set (a scheduler slow to answer); ``looks``
    counts the questions asked; ``alive`` is the answer."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.looks = 0
        self.alive: set[str] = {OLD}
        self.states: dict = {}

    def workers(self) -> set[str]:
        self.looks += 1
        assert self.release.wait(30), "the test never released the look"
        return set(self.alive)

    def task_states(self, keys: list) -> dict:
        return {k: self.states.get(k, "processing") for k in keys}


def _executor(tmp_path, cells) -> Executor:
    ex = Executor(
        cells, Gateway(), Store(str(tmp_path / "store")), "watch", NoMembersWork(),
        EngineSpec("none"), watch_s=0.0, heal_timeout_s=600.0,
    )  # fmt: skip
    ex.roles[0] = "rollout"
    return ex


def _events_in_thread(ex: Executor, timeout: float = 0.05) -> list:
    """``ex.events`` on a thread of its own: it must come back within 10 s (a loop that
    waited for the held look would never come back)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(ex.events(timeout=timeout)), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "events() waited for the scheduler's answer on the loop"
    return out[0]


def _started(cells: HeldCells, n: int) -> None:
    """The look runs on a thread of its own: wait (up to 10 s) until ``n`` were asked."""
    for _ in range(1000):
        if cells.looks >= n:
            return
        time.sleep(0.01)
    raise AssertionError(f"{cells.looks} looks asked for, not {n}")


def test_the_loop_does_not_wait_for_a_look_at_the_workers(tmp_path):
    cells = HeldCells()
    ex = _executor(tmp_path, cells)
    try:
        for _ in range(5):
            assert _events_in_thread(ex) == []
        _started(cells, 1)
        assert _events_in_thread(ex) == []
        assert cells.looks == 1, f"one look at a time, not {cells.looks}"
        assert not ex.membership.is_lost(0)
        cells.alive = set()  # the cell's worker died while the scheduler was slow to say
        cells.release.set()
        for _ in range(100):
            _events_in_thread(ex, timeout=0.1)
            if ex.membership.is_lost(0):
                break
        assert ex.membership.is_lost(0), "the answer of the look was not carried out"
        assert ex.stats.cells_lost == 1
    finally:
        cells.release.set()
        ex.close()


def test_a_forced_look_during_one_under_way_is_made_after_it(tmp_path):
    cells = HeldCells()
    ex = _executor(tmp_path, cells)
    ex.watch_s = 1e9  # only forced looks after the first (1e9 s: longer than any uptime)
    try:
        assert _events_in_thread(ex) == []
        _started(cells, 1)
        assert cells.looks == 1
        ex._q.put(("healed", 0))  # a heal done: the workers must be looked at again
        _events_in_thread(ex)
        assert cells.looks == 1, "a second look beside the one under way"
        cells.release.set()
        for _ in range(100):
            _events_in_thread(ex, timeout=0.1)
            if cells.looks == 2 and ex._looking is None:
                break
        assert cells.looks == 2, "the forced look was dropped"
    finally:
        cells.release.set()
        ex.close()


@dataclass
class KeyedJob:
    key: str

    def done(self) -> bool:
        return False


def test_no_worker_is_read_only_for_the_task_it_was_asked_of(tmp_path):
    cells = HeldCells()
    cells.release.set()
    ex = _executor(tmp_path, cells)
    try:
        ex.groups = {
            0: Group(0, 0, 0.0, phase="rollout", deadline=1e18),
            1: Group(1, 0, 0.0, phase="rollout", deadline=1e18),
        }
        ex.groups[0].job, ex.groups[1].job = KeyedJob("roll-0"), KeyedJob("roll-1")
        keys = ex._unrunnable_keys(now=1e9)
        assert keys == {0: "roll-0", 1: "roll-1"}
        ex.groups[1].phase, ex.groups[1].job = "process", KeyedJob("proc-1")  # moved on
        ex._check_unrunnable({"roll-0": "no-worker", "roll-1": "no-worker"}, now=1e9)
        assert set(ex._no_worker) == {0}, ex._no_worker
        ex._check_unrunnable({"roll-0": "processing on tcp://x"}, now=1e9 + 1)
        assert ex._no_worker == {}
    finally:
        ex.close()
