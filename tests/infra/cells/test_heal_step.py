"""Healing a train cell lost mid-step, on real cells (infra/cells/healing.py): a LocalCluster
of two train cells, one SIGKILLed while a step over both runs; its nanny restarts it and the
executor heals it. The step's members are futures the test holds (no training: what is under
test is what the executor does with the step).

- The retry forms a NEW DP generation with the healed cell (its new worker), at a new
  rendezvous, and is submitted only once the healed cell's preloaded modules are imported
  (a restarted worker imports torch and the tasks for 10-60 s on a loaded host; the
  survivor then waited out its rendezvous for it: the fsdp-two-members retry of issue 27).
- A step that committed before its member was lost is never trained again: the executor
  finishes it from its commit record, the ``Work`` port gets no second step.
- The loss is recorded before the step's abort, however the executor learns of it (here:
  from the survivor's failed collective, before a look at the workers).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from infra.cells.cluster import start_cells
from infra.cells.executor import EngineSpec, Executor
from storage.checkpoints import stage_checkpoint
from storage.commits import commit_step_record
from storage.sql import query
from storage.store import Store
from tasks.handles import TrainedStep
from tasks.sched.coordinator import RolloutFinished, StartRollouts, StartStep, StepFinished
from tests.infra.cells.jobs import FutureJob

pytestmark = pytest.mark.integration

RUN = "heal"
SLOW = "tests.infra.cells.slow_import"


@dataclass
class _Processed:
    samples_segment: str | None = None


class Job(FutureJob):
    """A future the test holds, through the executor's ``Job`` verbs (and ``cancel``)."""

    def __init__(self, fut: cf.Future | None = None):
        super().__init__(fut or cf.Future())

    def cancel(self) -> None:
        self.fut.cancel()


def _done(value) -> Job:
    f: cf.Future = cf.Future()
    f.set_result(value)
    return Job(f)


def _preload_done(dask_worker=None) -> float | None:
    """On a cell: when its slow preload finished importing (None: not yet)."""
    mod = sys.modules.get(SLOW)
    return getattr(mod, "DONE_AT", None)


class StepWork:
    """Groups that finish at once with nothing to train; each step's members are futures
    the test ends. At each step's submit it notes when each member's preload was done."""

    def __init__(self, cells):
        self.cells = cells
        self.plans: list = []
        self.jobs: list[list[Job]] = []
        self.preloaded: list[dict[str, tuple[float | None, float]]] = []  # (done, submit)

    def rollout(self, index: int, cell_id: str) -> Job:
        return _done([])

    def process(self, index, sessions, version, workers=()) -> Job:
        return _done(_Processed())

    def step(self, plan) -> list[Job]:
        t = time.time()
        self.plans.append(plan)
        done = self.cells.client.run(_preload_done, workers=list(plan.workers))
        self.preloaded.append({w: (at, t) for w, at in done.items()})
        self.jobs.append([Job() for _ in plan.workers])
        return self.jobs[-1]


class NoGateway:
    """The executor's gateway verbs that a run with train cells only uses."""

    def drop_engine(self, cell_id: str) -> None: ...

    def end_session(self, session_id: str) -> None: ...

    def flush(self) -> None: ...

    def group_sessions(self, group_id: str) -> list:
        return []


def _wait(ex: Executor, seen: list, done, timeout: float = 180) -> None:
    """Feed the executor's events into ``seen`` until ``done()`` holds."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out after {timeout}s; saw {seen}"
        seen += ex.events(timeout=0.2)


def _until(ex: Executor, seen: list, want, timeout: float = 180) -> None:
    _wait(ex, seen, lambda: any(want(e) for e in seen), timeout)


@contextmanager
def _two_train_cells(tmp_path, preload: tuple[str, ...]):
    """Two train cells under an executor, one group finished (a step can start): yields
    the cells, the work, the executor and the events seen so far."""
    store = Store(str(tmp_path / "store"))
    with start_cells(2, threads_per_cell=1, rollout_slots=1, harness_slots=1,
                     preload=preload) as cells:  # fmt: skip
        work = StepWork(cells)
        ex = Executor(
            cells, NoGateway(), store, RUN, work, EngineSpec(model_dir="unused"),
            step_timeout_s=60, heal_timeout_s=120, watch_s=3.0,
        )  # fmt: skip
        try:
            ex.start(("train", "train"), "test")
            seen: list = []
            ex.apply(StartRollouts(0, 1), "test")
            _until(ex, seen, lambda e: isinstance(e, RolloutFinished))
            yield cells, work, ex, seen
        finally:
            ex.close()


def _commit(store: Store, plan) -> None:
    """What rank 0 leaves when it committed the step (storage/commits.py) just before its
    cell was lost: the new version's checkpoint, its ledger and steps rows."""
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            fh.write("{}")
        url = stage_checkpoint(store, RUN, tmp, plan.version + 1)
    ledger = [{"run_id": RUN, "step": plan.step, "sample_id": "s0", "weight_version": 1,
               "t": time.time(), "lag_mean": 0.0, "lag_max": 0}]  # fmt: skip
    row = {
        "run_id": RUN, "step": plan.step, "weight_version": plan.version + 1, "loss": 0.5,
        "tokens": 10, "trainable_tokens": 5, "reward": 0.25, "n_samples": 1, "grad_norm": 1.0,
        "mean_staleness": 0.0, "cells": list(plan.members), "t_start": time.time(),
        "t_end": time.time(), "checkpoint": url, "lag_mean": 0.0, "lag_max": 0,
        "n_members": len(plan.members), "generation": plan.generation, "mode": "",
        "dropped_tokens": 0,
    }  # fmt: skip
    commit_step_record(store, RUN, plan.step, plan.version + 1, ledger, row)


def _lose_a_member_mid_step(tmp_path, commit_first: bool):
    """Two train cells, a step over both, cell 1 SIGKILLed and healed; returns what the
    executor did (the work's plans, the events, the store, the addresses before)."""
    preload = () if commit_first else (SLOW,)  # the slow preload matters to the retry
    with _two_train_cells(tmp_path, preload) as (cells, work, ex, seen):
        ex.apply(StartStep((0, 1), 1), "test")
        before = list(ex.addrs)
        (plan,) = work.plans
        if commit_first:
            _commit(ex.store, plan)
            work.jobs[0][0].fut.set_result(
                TrainedStep(plan.step, plan.version + 1, "", {})
            )  # rank 0 committed and returned; rank 1's cell dies before it returns
        else:  # rank 0 is told first, as gloo tells a survivor (its peer's socket
            # closed) before the scheduler hears of the death: the executor learns of
            # the loss from the failed member, not from a look at the workers
            work.jobs[0][0].fut.set_exception(RuntimeError("Connection closed by peer"))
        os.kill(cells.pids()[before[1]], signal.SIGKILL)
        _until(ex, seen, lambda e: isinstance(e, StepFinished) or len(work.plans) > 1)
        if not commit_first:
            retry = work.plans[1]
            for job in work.jobs[1]:
                job.fut.set_result(TrainedStep(retry.step, retry.version + 1, "", {}))
            _until(ex, seen, lambda e: isinstance(e, StepFinished))
        return work, seen, ex, before


def test_a_healed_member_joins_a_new_generation_once_it_is_ready(tmp_path):
    work, _, ex, before = _lose_a_member_mid_step(tmp_path, commit_first=False)
    first, retry = work.plans
    assert ex.addrs[1] != before[1]  # the restarted worker holds cell 1
    assert retry.step == first.step and retry.version == first.version
    assert retry.groups == first.groups and retry.segments == first.segments
    # a new generation of the new members, at a new rendezvous (the old one was dropped)
    assert retry.generation == first.generation + 1
    assert retry.workers == (before[0], ex.addrs[1])
    assert retry.members == (ex.cell_id(0), ex.cell_id(1)) != first.members
    assert retry.port != first.port
    # submitted once the healed cell had imported what its cell preloads
    (done, submitted) = work.preloaded[1][ex.addrs[1]]
    assert done is not None and done <= submitted, work.preloaded[1]
    assert ex.version == first.version + 1 and ex.stats.step_retries == 1
    # the loss before the abort it caused
    events = query(
        ex.store, "SELECT cell_id, event FROM cells WHERE event IN ('lost', 'step_abort', "
        "'rejoin') ORDER BY t",
    ).to_pylist()  # fmt: skip
    kinds = [e["event"] for e in events]
    assert kinds[0] == "lost" and kinds.count("step_abort") == 2 and kinds[-1] == "rejoin", kinds


def test_a_step_committed_before_the_loss_is_never_trained_again(tmp_path):
    work, seen, ex, _ = _lose_a_member_mid_step(tmp_path, commit_first=True)
    assert len(work.plans) == 1, work.plans  # no retry: it would train the samples twice
    assert len([e for e in seen if isinstance(e, StepFinished)]) == 1
    assert ex.version == 1 and ex.last_step.weight_version == 1
    assert ex.last_step.metrics["train/loss"] == 0.5  # from the commit record
    steps = query(ex.store, f"SELECT step FROM steps WHERE run_id = '{RUN}'").to_pylist()
    assert steps == [{"step": 0}]


def test_a_step_over_a_cell_lost_between_steps_waits_for_its_heal(tmp_path):
    """The coordinator books a step with the cells it knows; one of them was lost after the
    last step and heals now. The step is submitted once the cell is back (on its new worker,
    its preload in), as a new generation, not at once with the dead worker as a member."""
    with _two_train_cells(tmp_path, (SLOW,)) as (cells, work, ex, seen):
        before, gen = list(ex.addrs), ex.generation
        os.kill(cells.pids()[before[1]], signal.SIGKILL)
        _wait(ex, seen, lambda: ex.membership.is_lost(1), 120)  # the executor saw it go
        ex.apply(StartStep((0, 1), 1), "test")  # booked with the healing cell
        _wait(ex, seen, lambda: bool(work.plans))
        (plan,) = work.plans
        assert ex.addrs[1] != before[1]  # healed onto the restarted worker
        assert plan.workers == (before[0], ex.addrs[1]), (plan.workers, before)
        assert plan.generation > gen
        (done, submitted) = work.preloaded[0][ex.addrs[1]]
        assert done is not None and done <= submitted, work.preloaded[0]
        for job in work.jobs[0]:
            job.fut.set_result(TrainedStep(plan.step, plan.version + 1, "", {}))
        _until(ex, seen, lambda e: isinstance(e, StepFinished))
        assert ex.version == 1 and len(work.plans) == 1
