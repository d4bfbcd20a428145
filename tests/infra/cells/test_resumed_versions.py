"""A resumed run's executor speaks two version counts and must never mix them.

The Coordinator counts policy versions from 0 at the start of every invocation (its lag
admission is ``(version + max_lag + 1) * batch - started``, both counted from there); the
store's checkpoints carry the run's versions, which continue after ``--resume``. The
executor is the one translation point: a ``LoadWeights(cell, k)`` from the coordinator
means checkpoint ``start + k``, and the ``WeightsLoaded`` it answers is in the coordinator's
count again. Before the fix a resumed cell serving v5 was told to "load v1", skipped it as
older, and kept the weights it resumed from (issue 15).

A LocalCluster of one cell, a real engine and the gateway; checkpoints v5 and v6 only.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import pytest

from infra.cells.cluster import start_cells
from infra.cells.executor import EngineSpec, Executor
from infra.engine.tiny_model import make_tiny_model
from infra.engine_api.client import EngineClient
from infra.gateway.gateway import Gateway
from storage.checkpoints import publish_checkpoint
from storage.store import Store
from tasks.sched.coordinator import LoadWeights, WeightsLoaded

pytestmark = pytest.mark.integration


class _NoWork:  # no units of work in this test: only weight loads
    def rollout(self, index, cell_id):  # pragma: no cover
        raise AssertionError

    process = step = rollout


def _served(url: str) -> int:
    async def ask() -> str:
        async with EngineClient(url) as c:
            return await c.weight_version()

    return int(asyncio.run(ask()))


def test_a_resumed_executor_loads_the_run_version_the_coordinator_means(tmp_path):
    store = Store(str(tmp_path / "store"))
    run_id = "resumed"
    model_dir = make_tiny_model()
    for v in (5, 6):  # a run resumed at v5; its next step publishes v6
        publish_checkpoint(store, run_id, model_dir, v)
    with start_cells(1, threads_per_cell=1, rollout_slots=2, harness_slots=2) as cells:
        gw = Gateway(
            store,
            run_id=run_id,
            tokenizer_dir=model_dir,
            admin_token=secrets.token_urlsafe(8),
            spool_dir=str(tmp_path / "spool"),
        )
        gw.start()
        ex = Executor(
            cells, gw, store, run_id, _NoWork(), EngineSpec(model_dir=model_dir), version=5
        )
        try:
            ex.start(("rollout",), "test")
            assert ex.engine_version == {0: 5} and _served(ex.engine_url[0]) == 5
            ex.version = 6  # a step published v6: the coordinator's v1
            ex.apply(LoadWeights(0, 1), "test: the coordinator's v1 is the run's v6")
            seen, deadline = [], time.monotonic() + 120
            while not any(isinstance(e, WeightsLoaded) for e in seen):
                assert time.monotonic() < deadline, f"timed out; saw {seen}"
                seen += ex.events(timeout=0.2)
            assert WeightsLoaded(0, 1) in seen  # answered in the coordinator's count
            assert ex.engine_version[0] == 6
            assert _served(ex.engine_url[0]) == 6  # the engine itself serves v6
            assert ex.pin(0) == 6  # evaluations are pinned in the run's count
            ex.unpin(0)
        finally:
            ex.close()
            gw.stop()
