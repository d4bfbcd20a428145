"""Cells and the Dask machinery under them (infra/cells/cluster.py).

- No statistical profiler in the cells: on CPython 3.11 < 3.11.9 its
  ``sys._current_frames()`` can deadlock a process whose threads come and go (one per
  agent session), which froze a run's train step (``stop_thread_profiler``).
- The cells' workers are listed from the scheduler, not the client's cache (which a
  refresh leaves without workers): read from the cache, every cell of a run looked lost
  when another run started on the host (``worker_addrs``).
- A task waiting for a worker with its resources runs once a cell gets the role that
  carries them: Dask itself re-examines such tasks only when a worker joins, so a rollout
  task whose cell died while no other cell held its resource waited forever
  (``Cells.set_role``); and one that no cell can take for longer than a heal stops the
  run with an error that says so, instead of waiting out the task's deadline
  (``Executor._check_unrunnable``).
"""

from __future__ import annotations

import time

import pytest

from infra.cells.cluster import start_cells
from infra.cells.executor import EngineSpec, Executor, ExecutorError
from storage.store import Store

pytestmark = pytest.mark.integration


def _callbacks(dask_worker) -> list[str]:
    return sorted(dask_worker.periodic_callbacks)


def test_cells_have_no_thread_profiler():
    with start_cells(1, threads_per_cell=1, harness_slots=1) as cells:
        seen = cells.client.run(_callbacks)
        assert seen and all("profile" not in cbs for cbs in seen.values()), seen


def test_cells_are_listed_from_the_scheduler_not_the_clients_cache():
    """The client's cached identity lists no workers once its periodic refresh ran, and
    stays stale when a refresh fails: read from it, every cell looked lost at once."""
    from distributed.client import SchedulerInfo

    with start_cells(2, threads_per_cell=1, harness_slots=1) as cells:
        client = cells.client
        expected = set(cells.roles)

        async def refresh_fails(n_workers=0):  # what a refresh under load may do
            return None

        client._update_scheduler_info = refresh_fails
        client._scheduler_identity = SchedulerInfo({"workers": {}})
        assert cells.workers() == expected
        assert cells.alive() == expected


def test_a_task_waiting_for_a_role_runs_when_a_cell_takes_it():
    with start_cells(2, threads_per_cell=1, harness_slots=1) as cells:
        a = sorted(cells.roles)[0]
        fut = cells.client.submit(lambda: "ran", resources={"rollout": 1}, pure=False)
        deadline = time.monotonic() + 30
        while (state := cells.task_state(fut.key)) != "no-worker":
            assert time.monotonic() < deadline, state  # no cell has the rollout role yet
            time.sleep(0.1)
        cells.set_role(a, "rollout")
        assert fut.result(timeout=30) == "ran"


class _DaskJob:
    def __init__(self, fut):
        self.fut, self.key = fut, fut.key

    def done(self):
        return self.fut.done()

    def result(self):
        return self.fut.result()

    def add_done_callback(self, fn):
        self.fut.add_done_callback(lambda _f: fn())

    def cancel(self):
        self.fut.cancel()


class _Unrunnable:
    """Rollout tasks that need a resource no cell holds (what a lost role looks like)."""

    def __init__(self, client):
        self.client = client

    def rollout(self, index, cell_id):
        return _DaskJob(self.client.submit(lambda: [], resources={"absent": 1}, pure=False))

    def process(self, index, sessions, version, workers=()):  # pragma: no cover - never reached
        raise AssertionError("the rollout never ran")

    def step(self, plan):  # pragma: no cover - no step here
        raise AssertionError("no step here")


def test_a_rollout_task_no_cell_can_run_stops_the_run_after_a_heal_bound(tmp_path):
    store = Store(str(tmp_path / "store"))
    with start_cells(1, threads_per_cell=1, harness_slots=1) as cells:
        ex = Executor(
            cells, None, store, "stuck", _Unrunnable(cells.client), EngineSpec(model_dir=""),
            heal_timeout_s=2.0, watch_s=0.2,
        )  # fmt: skip
        try:
            ex.start(("idle",), "test")
            ex._start_group(0)
            t0 = time.monotonic()
            with pytest.raises(ExecutorError, match="no cell could run its task"):
                while time.monotonic() - t0 < 60:
                    ex.events(timeout=0.2)
            assert time.monotonic() - t0 < 20  # the heal bound plus a check period or two
        finally:
            ex.close()
