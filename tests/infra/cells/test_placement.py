"""Where a finished group is processed, and what each role change cost, on the real
executor (infra/cells/executor.py): a LocalCluster of two cells, real engines, the
gateway; rollouts that end at once (their sessions are not under test).

- Processing goes to the steady rollout cells (``Executor.process_addrs``, handed to the
  ``Work`` port): never a cell on its way between roles nor a train cell, a cell with a
  weight load decided only when every rollout cell has one, any of the rest (a cell
  back from training too: not only elastic's core); Dask would see a cell busy draining, parking or loading as free
  (those are ``Client.run`` calls, not tasks).
- Every role change and decided weight load writes its measured parts into its ``cells``
  row (``seconds``, ``wait_s``, ``drain_s``, ``park_s``, ``load_s``).
"""

from __future__ import annotations

import concurrent.futures as cf
import secrets
import time
from dataclasses import dataclass

import pytest

from infra.cells.cluster import start_cells
from infra.cells.executor import EngineSpec, Executor
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.gateway import Gateway
from storage.checkpoints import publish_checkpoint
from storage.store import Store
from tasks.sched.coordinator import (
    LoadWeights,
    Move,
    MoveDone,
    RolloutFinished,
    StartRollouts,
    WeightsLoaded,
)
from tests.infra.cells.jobs import FutureJob

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # ~25-45 s on the shared cores


@dataclass
class _Processed:
    samples_segment: str | None = None


def _done(value) -> FutureJob:
    f: cf.Future = cf.Future()
    f.set_result(value)
    return FutureJob(f)


class _PlacedWork:
    """Rollouts with no session, processing that notes where it was told to run."""

    def __init__(self):
        self.placed: list[tuple[str, ...]] = []

    def rollout(self, index, cell_id):
        return _done([])

    def process(self, index, sessions, version, workers=()):
        self.placed.append(tuple(workers))
        return _done(_Processed())

    def step(self, plan):  # pragma: no cover - no step here
        raise AssertionError("no step here")


def _until(ex: Executor, want, timeout: float = 180) -> list:
    seen, deadline = [], time.monotonic() + timeout
    while not any(want(e) for e in seen):
        assert time.monotonic() < deadline, f"timed out; saw {seen}"
        seen += ex.events(timeout=0.2)
    return seen


def test_processing_goes_to_steady_rollout_cells_and_moves_record_their_costs(tmp_path):
    store = Store(str(tmp_path / "store"))
    run_id = "placed"
    model_dir = make_tiny_model()
    for v in (0, 1):  # v2 comes later
        publish_checkpoint(store, run_id, model_dir, v)
    with start_cells(2, threads_per_cell=1, rollout_slots=2, harness_slots=2) as cells:
        gw = Gateway(
            store,
            run_id=run_id,
            tokenizer_dir=model_dir,
            admin_token=secrets.token_urlsafe(8),
            spool_dir=str(tmp_path / "spool"),
        )
        gw.start()
        work = _PlacedWork()
        ex = Executor(cells, gw, store, run_id, work, EngineSpec(model_dir=model_dir), version=0)
        a = ex.addrs
        try:
            ex.start(("rollout", "rollout"), "test")
            assert ex.process_addrs() == (a[0], a[1])
            ex.apply(StartRollouts(0, 1), "test")
            _until(ex, lambda e: isinstance(e, RolloutFinished))
            assert work.placed == [(a[0], a[1])]  # what the Work port was told
            ex.version = 1
            ex.apply(LoadWeights(0, 1), "test: a load decided for cell 0")
            assert ex.process_addrs() == (a[1],)  # decided, not yet begun: already not there
            seen = _until(ex, lambda e: e == WeightsLoaded(0, 1))
            assert ex.process_addrs() == (a[0], a[1]), seen
            ex.version = 2
            publish_checkpoint(store, run_id, model_dir, 2)
            ex.apply(LoadWeights(0, 2), "test: both rollout cells load")
            ex.apply(LoadWeights(1, 2), "test: both rollout cells load")
            assert ex.process_addrs() == (a[0], a[1])  # still the rollout cells
            seen = _until(ex, lambda e: e == WeightsLoaded(1, 2))
            if WeightsLoaded(0, 2) not in seen:
                _until(ex, lambda e: e == WeightsLoaded(0, 2))
            ex.apply(Move(1, "train"), "test: cell 1 to train")
            assert ex.process_addrs() == (a[0],)  # on its way
            _until(ex, lambda e: isinstance(e, MoveDone) and e.cell == 1)
            assert ex.process_addrs() == (a[0],)  # a train cell
            ex.version = 3  # a step published v3 meanwhile: cell 1 comes back with it
            publish_checkpoint(store, run_id, model_dir, 3)
            ex.apply(Move(1, "rollout"), "test: cell 1 back to rollout")
            _until(ex, lambda e: isinstance(e, MoveDone) and e.cell == 1)
            assert ex.process_addrs() == (a[0], a[1])  # cell 1 rolls out again: steady
            ex.apply(Move(0, "train"), "test: the never-moved cell goes too")
            assert ex.process_addrs() == (a[1],)  # the one steady rollout cell left
            ex.apply(StartRollouts(1, 1), "test")
            _until(ex, lambda e: isinstance(e, RolloutFinished) and e.cell == 1)
            assert work.placed[-1] == (a[1],)
            _until(ex, lambda e: isinstance(e, MoveDone) and e.cell == 0)
        finally:
            ex.close()
            gw.stop()
    rows = store.read("cells").to_pylist()

    def row(cell: int, event: str, role: str) -> dict:  # the first such row
        return min(
            (
                x
                for x in rows
                if x["cell_id"] == ex.cell_id(cell) and (x["event"], x["role"]) == (event, role)
            ),
            key=lambda x: x["t"],
        )

    to_train = row(1, "role", "train")  # a serving cell: withdrawn, then parked
    assert to_train["drain_s"] >= 0 and to_train["park_s"] > 0 and to_train["wait_s"] >= 0
    assert to_train["seconds"] >= max(to_train["drain_s"], to_train["park_s"])
    to_roll = row(1, "role", "rollout")  # its parked engine loads the newest weights
    assert to_roll["load_s"] > 0 and to_roll["seconds"] >= to_roll["load_s"]
    load = row(0, "load_weights", "rollout")
    assert load["load_s"] > 0 and load["seconds"] >= load["load_s"] + load["wait_s"] - 1e-3
    assert row(0, "decide", "draining")["seconds"] is None  # a decision costs nothing yet
