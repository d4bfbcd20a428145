"""Exactly-once training across DP joins and leaves, on real cells.

Real sessions (openai client -> gateway -> engine on a rollout cell), real processing, and
real data-parallel steps over gloo on the train cells of a LocalCluster, through the
executor, while the membership changes: {B} -> {B, C} (C joins and receives B's state) ->
{C} (B leaves) -> {B, C} (B rejoins with a stale replica). The ledger must hold every
sample of every trained group exactly once, each step's generation must change with its
members, and the versions must run 1..4.
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
from tasks.sched.coordinator import RolloutFinished, StartRollouts, StartStep, StepFinished
from tasks.train.config import TrainConfig
from tasks.train_step import member_on_cell
from tests.infra.cells.jobs import FutureJob

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RCFG = RolloutConfig(group_size=2, subtasks=1, max_new_tokens=8, max_attempts=2, timeout_s=300)
# every group trains, also one whose rewards tie (the test counts samples per group)
TCFG = TrainConfig(lr=1e-3, max_staleness=4, filter_zero_variance=False)


class Work:
    """Rollouts and processing on threads; each DP member a Dask task on its cell."""

    def __init__(self, gw, store, run_id, cells):
        self.gw, self.store, self.run_id, self.cells = gw, store, run_id, cells
        self.pool = cf.ThreadPoolExecutor(4)
        self.by_id = {cells.cell_id(a): a for a in cells.roles}

    def rollout(self, index: int, cell_id: str) -> FutureJob:
        spec = GroupSpec(index, f"g{index}", 300 + index, 1, cell_id=cell_id)
        args = (self.gw.url, self.gw.admin_token, self.store, self.run_id, spec, RCFG)
        return FutureJob(self.pool.submit(roll_out_group, *args))

    def process(self, index, sessions, version, workers=()) -> FutureJob:
        return FutureJob(
            self.pool.submit(
                process_sessions,
                self.store,
                self.run_id,
                index,
                sessions,
                current_version=version,
                filter_zero_variance=TCFG.filter_zero_variance,
            )
        )

    def step(self, plan) -> list[FutureJob]:
        return [
            FutureJob(
                self.cells.client.submit(
                    member_on_cell,
                    self.store,
                    self.run_id,
                    plan,
                    rank,
                    TCFG,
                    timeout_s=120,
                    workers=[self.by_id[cid]],
                    allow_other_workers=False,
                    pure=False,
                )
            )
            for rank, cid in enumerate(plan.members)
        ]


def _until(ex: Executor, seen: list, want, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not want(seen):
        assert time.monotonic() < deadline, f"timed out after {timeout}s; saw {seen}"
        seen += ex.events(timeout=0.5)


def test_ledger_exactly_once_across_joins_and_leaves(tmp_path):
    store = Store(str(tmp_path / "store"))
    run_id = "ledger"
    model_dir = make_tiny_model()
    publish_checkpoint(store, run_id, model_dir, 0)
    with start_cells(3, threads_per_cell=2, rollout_slots=4, harness_slots=4) as cells:
        gw = Gateway(
            store,
            run_id=run_id,
            tokenizer_dir=model_dir,
            admin_token=secrets.token_urlsafe(8),
            spool_dir=str(tmp_path / "spool"),
        )
        gw.start()
        ex = Executor(
            cells, gw, store, run_id, Work(gw, store, run_id, cells), EngineSpec(model_dir)
        )
        try:
            ex.start(("rollout", "train", "train"), "test: roles")
            seen: list = []
            ex.apply(StartRollouts(0, 4), "test")
            _until(ex, seen, lambda s: sum(isinstance(e, RolloutFinished) for e in s) == 4)
            for k, members in enumerate([(1,), (1, 2), (2,), (1, 2)]):
                ex.apply(StartStep(members, 1, order="index"), f"test: step {k}")
                _until(ex, seen, lambda s, k=k: sum(isinstance(e, StepFinished) for e in s) > k)
        finally:
            ex.close()
            gw.stop()
    steps = query(store, "SELECT * FROM steps ORDER BY step").to_pylist()
    assert [s["weight_version"] for s in steps] == [1, 2, 3, 4]
    assert [s["n_members"] for s in steps] == [1, 2, 1, 2]
    assert [s["generation"] for s in steps] == [0, 1, 2, 3]  # a new group at every change
    ledger = query(store, "SELECT step, sample_id FROM ledger").to_pylist()
    ids = [r["sample_id"] for r in ledger]
    assert len(ids) == len(set(ids)) == 8  # 4 groups x 2 sessions, each once
    samples = {r["sample_id"] for r in query(store, "SELECT sample_id FROM samples").to_pylist()}
    assert set(ids) == samples  # none lost: every processed sample was trained
    per_step = {}
    for r in ledger:
        per_step[r["step"]] = per_step.get(r["step"], 0) + 1
    assert per_step == {0: 2, 1: 2, 2: 2, 3: 2}
