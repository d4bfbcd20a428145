"""Evaluation pins on the real executor: a pinned rollout cell keeps serving the weights it
had until it is unpinned (flows/evaluation.py measures exactly one version that way).

A LocalCluster of two cells, real engines and the gateway: a weight load and a role change
decided for a pinned cell wait; one for the other cell does not; a cell with a load under way
cannot be pinned.
"""

from __future__ import annotations

import secrets
import time

import pytest

from infra.cells.cluster import start_cells
from infra.cells.executor import EngineSpec, Executor
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.gateway import Gateway
from storage.checkpoints import publish_checkpoint
from storage.store import Store
from tasks.sched.coordinator import LoadWeights, Move, MoveDone, WeightsLoaded

pytestmark = pytest.mark.integration


class _NoWork:  # no units of work in this test: only weight loads and role changes
    def rollout(self, index, cell_id):  # pragma: no cover
        raise AssertionError

    process = step = rollout


def _events(ex: Executor, seconds: float) -> list:
    seen, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen += ex.events(timeout=0.2)
    return seen


def _until(ex: Executor, want, timeout: float = 120) -> list:
    seen, deadline = [], time.monotonic() + timeout
    while not any(want(e) for e in seen):
        assert time.monotonic() < deadline, f"timed out; saw {seen}"
        seen += ex.events(timeout=0.2)
    return seen


def test_a_pinned_cell_keeps_its_weights_until_unpinned(tmp_path):
    store = Store(str(tmp_path / "store"))
    run_id = "pin"
    model_dir = make_tiny_model()
    for v in (0, 1, 2):
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
        ex = Executor(
            cells, gw, store, run_id, _NoWork(), EngineSpec(model_dir=model_dir), version=0
        )
        try:
            ex.start(("rollout", "rollout"), "test")
            assert ex.pin(0) == 0  # serving v0
            assert ex.pin(0) is None  # one pin at a time
            ex.apply(LoadWeights(0, 1), "test: a load decided while pinned")
            ex.apply(LoadWeights(1, 1), "test: the other cell is not pinned")
            seen = _events(ex, 4.0)
            assert WeightsLoaded(1, 1) in seen and WeightsLoaded(0, 1) not in seen
            assert ex.engine_version == {0: 0, 1: 1}
            ex.unpin(0)
            _until(ex, lambda e: e == WeightsLoaded(0, 1))
            assert ex.engine_version[0] == 1
            # a role change waits too, and the engine keeps serving meanwhile
            assert ex.pin(1) == 1
            ex.apply(Move(1, "train"), "test: a move decided while pinned")
            assert not any(isinstance(e, MoveDone) for e in _events(ex, 3.0))
            assert 1 in ex.routed
            ex.unpin(1)
            _until(ex, lambda e: e == MoveDone(1))
            assert 1 not in ex.routed and ex.pin(1) is None  # not serving: nothing to pin
            # while a load is under way the cell cannot be pinned (it would serve two versions)
            ex.version = 2
            ex.apply(LoadWeights(0, 2), "test")
            pinned_during_load = None
            deadline = time.monotonic() + 60
            while ex.engine_version[0] != 2 and time.monotonic() < deadline:
                if 0 in ex._acting:
                    pinned_during_load = ex.pin(0)
                    break
                time.sleep(0.001)
            _until(ex, lambda e: e == WeightsLoaded(0, 2))
            assert pinned_during_load is None
        finally:
            ex.close()
            gw.stop()
