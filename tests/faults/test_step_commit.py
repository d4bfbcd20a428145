"""A step's checkpoint, ledger rows and steps row are one atomic commit.

A child process trains one real step (``train_on_samples``) and is SIGKILLed at a chosen
write: before the marker that commits the step, or after it (before the ledger rows, or
between the ledger rows and the steps row). Then the step is retried, as the executor or
``gyre run --resume`` would. What must hold after every crash and retry: the newest
version is visible only if the step committed, each sample is in the ledger exactly once,
the step has exactly one ``steps`` row, and a committed step is never trained again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.engine.tiny_model import make_tiny_model
from storage.checkpoints import latest_version, publish_checkpoint, read_commit
from storage.commits import roll_forward
from storage.sql import query
from storage.store import Store
from storage.tito import TitoRecord
from tasks.trajectory.sampler import build_samples
from tasks.trajectory.tree import TrajectoryTree

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]

RUN = "commit"
ROOT = Path(__file__).resolve().parents[2]


def _samples_segment(store: Store) -> tuple[str, list[str]]:
    """Two one-call sessions of one group with different rewards: two samples."""
    trees = []
    for sid, out in (("s1", [5, 6, 7]), ("s2", [8, 9])):
        t = TrajectoryTree(sid)
        t.add(TitoRecord(RUN, sid, f"{sid}-a", 0, None, 0, [1, 2, 3], out, [-1.0] * len(out), 0))
        trees.append(t)
    samples = build_samples(
        trees, {"s1": 1.0, "s2": 0.0}, {"s1": "g", "s2": "g"}, run_id=RUN, step=0
    )
    rows = [{**s.to_row(), "version_min": 0, "version_max": 0} for s in samples]
    return store.append("samples", rows), [s.sample_id for s in samples]


def _child(store: Store, segment: str, kill_at: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "tests.faults.commit_child", store.url, RUN, segment, kill_at],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )


def _ledger(store: Store) -> list[str]:
    rows = query(store, f"SELECT sample_id FROM ledger WHERE run_id = '{RUN}'").to_pylist()
    return sorted(r["sample_id"] for r in rows)


def _steps(store: Store) -> list[tuple[int, int]]:
    q = f"SELECT step, weight_version FROM steps WHERE run_id = '{RUN}' ORDER BY 1"
    return [(r["step"], r["weight_version"]) for r in query(store, q).to_pylist()]


@pytest.fixture
def store(tmp_path):
    st = Store(str(tmp_path / "store"))
    publish_checkpoint(st, RUN, make_tiny_model(), 0)
    return st


def test_killed_before_the_commit_leaves_nothing_and_the_retry_trains_once(store):
    segment, ids = _samples_segment(store)
    crashed = _child(store, segment, "commit")
    assert crashed.returncode == -9, crashed.stderr[-2000:]
    # the new version's files may be there, but nothing is committed
    assert store.exists("checkpoints", RUN, "v1", "model.safetensors")
    assert latest_version(store, RUN) == 0 and read_commit(store, RUN, 1) is None
    assert _ledger(store) == [] and _steps(store) == []
    retry = _child(store, segment, "none")
    assert retry.returncode == 0, retry.stderr[-2000:]
    assert "committed v1" in retry.stdout
    assert _ledger(store) == sorted(ids)
    assert _steps(store) == [(0, 1)]
    assert latest_version(store, RUN) == 1


@pytest.mark.parametrize("kill_at", ["ledger", "steps"])
def test_killed_after_the_commit_is_completed_never_retrained(store, kill_at):
    segment, ids = _samples_segment(store)
    crashed = _child(store, segment, kill_at)
    assert crashed.returncode == -9, crashed.stderr[-2000:]
    # committed: the version is visible and its record names the step and its samples
    assert latest_version(store, RUN) == 1
    record = read_commit(store, RUN, 1)
    assert record["step"] == 0 and sorted(r["sample_id"] for r in record["ledger"]) == sorted(ids)
    assert _ledger(store) == ([] if kill_at == "ledger" else sorted(ids))
    assert _steps(store) == []
    # a retry of the same step completes the rows and refuses to train the samples again
    retry = _child(store, segment, "none")
    assert retry.returncode != 0 and "already trained" in retry.stderr, retry.stderr[-2000:]
    assert latest_version(store, RUN) == 1
    assert _ledger(store) == sorted(ids)
    assert _steps(store) == [(0, 1)]
    assert roll_forward(store, RUN) == []  # idempotent: nothing left to complete
    assert _ledger(store) == sorted(ids) and _steps(store) == [(0, 1)]
