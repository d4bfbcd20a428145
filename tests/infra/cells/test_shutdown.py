"""Cells leave on their own at the end of a run: engines stopped, worker processes exit
without being killed (Dask kills a worker still alive 4 s after it was asked to close), a
task still running (a harness finishing its step) ends first, and tearing down never fails
(a run whose training is done must not fail in its teardown)."""

from __future__ import annotations

import logging
import time

import pytest

from infra.cells.cluster import start_cells, stop_cells
from infra.cells.engines import start_engine
from infra.engine.tiny_model import make_tiny_model

pytestmark = pytest.mark.integration


def _busy(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


def test_cells_stop_their_engines_and_leave_without_being_killed(caplog):
    model_dir = make_tiny_model()
    caplog.set_level(logging.WARNING, logger="distributed")
    with start_cells(2, threads_per_cell=1, rollout_slots=1, harness_slots=1) as cells:
        a, b = sorted(cells.roles)
        url = cells.run_on(a, start_engine, model_dir, cell_id=cells.cell_id(a))
        assert url.startswith("http://")
        # a task that outlives the request to close: the worker waits for it (5 s > Dask's 4)
        fut = cells.client.submit(_busy, 5.0, workers=[b], pure=False)
        while not cells.client.processing(workers=[b])[b]:
            time.sleep(0.05)
        t0 = time.monotonic()
    took = time.monotonic() - t0
    killed = [r.getMessage() for r in caplog.records if "still alive" in r.getMessage()]
    assert not killed, killed
    assert fut.status in ("finished", "cancelled", "lost")  # it ran to its end or was let go
    assert took < 60
    # a second teardown of what is already closed does not raise
    stop_cells(cells.client, cells.cluster, timeout=5)


def _write_while_stopping(path, n: int = 20) -> None:
    for i in range(n):  # what a run writes after its loop: summary, curve, artifacts
        (path / f"part{i}.txt").write_text(str(i))


def test_cells_torn_down_while_the_caller_writes_its_summary(tmp_path, caplog):
    """``stop_soon``: the teardown runs while the caller goes on; the end of the block
    waits for it: every file the caller wrote is there, every worker process has exited
    on its own (exit status 0, none killed), and no teardown is left running."""
    caplog.set_level(logging.WARNING, logger="distributed")
    with start_cells(2, threads_per_cell=1, rollout_slots=1, harness_slots=1) as cells:
        procs = [n.process.process for n in cells.cluster.workers.values()]
        t0 = time.monotonic()
        cells.stop_soon()
        returned_in = time.monotonic() - t0
        _write_while_stopping(tmp_path)
    assert returned_in < 1.0  # the caller was not held up by the teardown
    assert not cells.stopping.is_alive()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"part{i}.txt" for i in range(20))
    assert [p.exitcode for p in procs] == [0, 0]  # closed in order, quick exit included
    killed = [r.getMessage() for r in caplog.records if "still alive" in r.getMessage()]
    assert not killed, killed
