"""Sessions of a rollout task that died with its cell are marked in ``rollouts`` (issue 15).

When a cell's worker dies, Dask runs its rollout tasks again elsewhere, with new sessions;
the first attempt's calls stay in ``tito``. The executor marks those sessions with a
``rollouts`` row of status ``lost`` (reason "cell lost: ...", no reward), so that SQL tells
them apart from sessions that were trained on.

Executor level, on one real rollout cell with its engine and the gateway: the group's task
rolls the group out twice and returns only the second attempt's handles, as a task that Dask
reran after its first worker died returns (killing a worker: tests/faults, slow).
"""

from __future__ import annotations

import concurrent.futures as cf
import secrets
import time

import pytest

from infra.cells.cluster import start_cells
from infra.cells.executor import EngineSpec, Executor
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.gateway import Gateway
from storage.checkpoints import publish_checkpoint
from storage.sql import query
from storage.store import Store
from tasks.env.config import RolloutConfig
from tasks.handles import GroupSpec
from tasks.process import process_sessions
from tasks.rollout import roll_out_group
from tasks.sched.coordinator import RolloutFinished, StartRollouts
from tests.infra.cells.jobs import FutureJob

pytestmark = pytest.mark.integration

RCFG = RolloutConfig(group_size=2, subtasks=1, max_new_tokens=4, max_attempts=1, timeout_s=120)


class RerunWork:
    """A group's task whose first attempt died (its sessions made calls, its result is
    gone) and whose second attempt returns."""

    def __init__(self, gw, store, run_id):
        self.gw, self.store, self.run_id = gw, store, run_id
        self.pool = cf.ThreadPoolExecutor(2)
        self.first: list = []

    def _twice(self, spec):
        args = (self.gw.url, self.gw.admin_token, self.store, self.run_id, spec, RCFG)
        self.first = roll_out_group(*args)  # the attempt that "died with its cell"
        return roll_out_group(*args)

    def rollout(self, index: int, cell_id: str) -> FutureJob:
        return FutureJob(self.pool.submit(self._twice, GroupSpec(index, f"g{index}", 7, 1)))

    def process(self, index, sessions, version, workers=()) -> FutureJob:
        args = (self.store, self.run_id, index, sessions)
        return FutureJob(self.pool.submit(process_sessions, *args, current_version=version))

    def step(self, plan):  # pragma: no cover
        raise AssertionError


def test_sessions_of_a_task_that_died_with_its_cell_are_marked_lost(tmp_path):
    store = Store(str(tmp_path / "store"))
    run_id = "lost"
    model_dir = make_tiny_model()
    publish_checkpoint(store, run_id, model_dir, 0)
    with start_cells(1, threads_per_cell=1, rollout_slots=2, harness_slots=2) as cells:
        gw = Gateway(
            store,
            run_id=run_id,
            tokenizer_dir=model_dir,
            admin_token=secrets.token_urlsafe(8),
            spool_dir=str(tmp_path / "spool"),
        )
        gw.start()
        work = RerunWork(gw, store, run_id)
        ex = Executor(cells, gw, store, run_id, work, EngineSpec(model_dir))
        try:
            ex.start(("rollout",), "test")
            ex.apply(StartRollouts(0, 1), "test")
            seen, deadline = [], time.monotonic() + 120
            while not any(isinstance(e, RolloutFinished) for e in seen):
                assert time.monotonic() < deadline, f"timed out; saw {seen}"
                seen += ex.events(timeout=0.2)
        finally:
            ex.close()
            gw.stop()
    lost = {h.session_id for h in work.first}
    assert len(lost) == 2
    rows = query(
        store, "SELECT session_id, status, reason, reward, n_calls FROM rollouts"
    ).to_pylist()
    by = {r["session_id"]: r for r in rows}
    assert len(rows) == 4  # the lost attempt's two sessions and the rerun's two
    for sid in lost:
        assert by[sid]["status"] == "lost" and by[sid]["reason"].startswith("cell lost")
        assert by[sid]["reward"] is None and by[sid]["n_calls"] >= 1
    assert all(r["status"] != "lost" for s, r in by.items() if s not in lost)
    # the lost sessions' calls are in tito; SQL tells them apart by their rollouts row
    n = query(
        store,
        "SELECT count(*) AS n FROM tito t JOIN rollouts r USING (session_id) "
        "WHERE r.status = 'lost'",
    ).to_pylist()[0]["n"]
    assert n >= 2
