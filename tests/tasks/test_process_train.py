"""process -> train composed without Prefect or Dask: store in, store out, ledger guarantees."""

from __future__ import annotations

import numpy as np
import pytest

from infra.engine.tiny_model import make_tiny_model
from storage.checkpoints import latest_version, publish_checkpoint
from storage.sql import query
from storage.store import Store
from storage.tito import TitoRecord
from tasks.handles import SessionHandle
from tasks.process import process_sessions
from tasks.train.config import TrainConfig
from tasks.train_step import LedgerError, train_on_samples

pytestmark = pytest.mark.integration

TRAIN_CFG = TrainConfig(lr=1e-3, loss="ppo_clip", max_staleness=1, stale_policy="drop")


def _session(sid: str, rng: np.random.Generator) -> list[TitoRecord]:
    def ids(n):
        return rng.integers(10, 300, n).tolist()

    def rec(i, parent, k, new, out):
        return TitoRecord(
            "run",
            sid,
            f"{sid}-r{i}",
            i,
            parent,
            k,
            new,
            out,
            (-rng.random(len(out))).tolist(),
            0,
            "c0",
        )

    a = rec(0, None, 0, ids(20), ids(5))
    b = rec(1, a.request_id, 25, ids(6), ids(4))  # the next turn
    c = rec(2, a.request_id, 20, [], ids(5))  # a retry of the first answer: a branch
    return [a, b, c]


def test_process_then_train_then_ledger_refuses_replay(tmp_path):
    store = Store(str(tmp_path / "store"))
    rng = np.random.default_rng(0)
    sessions, records, scores = [], [], []
    for i, score in enumerate([1.0, 0.0, 0.5]):
        sid = f"s{i}"
        recs = _session(sid, rng)
        records += recs
        sessions.append(
            SessionHandle(sid, "g0", "t", step=0, status="finished", subtasks={"a": 1.0, "b": 1.0})
        )
        scores.append(
            {
                "run_id": "run",
                "session_id": sid,
                "subtask_id": "a",
                "score": score,
                "weight": 1.0,
                "at_request_id": recs[1].request_id,
                "source": "env",
                "status": "finished",
                "reason": "",
            }
        )
    # a sub-agent spawned by s0 finishes sub-task b for it
    sub = _session("s3", rng)
    records += sub
    sessions.append(
        SessionHandle("s3", "g0", "t", step=0, status="finished", parent_session_id="s0")
    )
    scores.append(
        {
            "run_id": "run",
            "session_id": "s3",
            "subtask_id": "b",
            "score": 1.0,
            "weight": 1.0,
            "at_request_id": sub[2].request_id,
            "source": "harness",
            "status": "finished",
            "reason": "",
        }
    )
    store.append("tito", [r.to_row() for r in records])
    store.append("scores", scores)

    out = process_sessions(store, "run", 0, sessions, current_version=0)
    assert out.n_calls == 12 and out.n_samples == 4
    assert out.tokens_unique < out.tokens_flat
    rows = query(
        store, "SELECT session_id, reward, parent_session_id FROM rollouts ORDER BY 1"
    ).to_pylist()
    # s1, s2: sub-task b was declared but never scored, so it counts 0 in the weighted mean;
    # s0 gets b from its sub-agent s3, whose row carries the reward of the rollout it serves
    assert [(r["reward"], r["parent_session_id"]) for r in rows] == [
        (1.0, None),
        (0.0, None),
        (0.25, None),
        (1.0, "s0"),
    ]
    branch = query(store, "SELECT count(*) AS n FROM nodes WHERE n_children > 1").to_pylist()
    assert branch[0]["n"] == 4  # one branch point per session (the retry)

    publish_checkpoint(store, "run", make_tiny_model(), 0)
    trained = train_on_samples(store, "run", 0, out.samples_segment, TRAIN_CFG)
    assert trained.weight_version == 1 and latest_version(store, "run") == 1
    m = trained.metrics
    assert m["train/trainable_tokens"] > 0 and np.isfinite(m["train/loss"])
    steps = query(store, "SELECT step, weight_version, n_samples FROM steps").to_pylist()
    assert steps == [{"step": 0, "weight_version": 1, "n_samples": 4}]
    assert query(store, "SELECT count(*) AS n FROM ledger").to_pylist() == [{"n": 4}]
    with pytest.raises(LedgerError, match="already trained"):
        train_on_samples(store, "run", 1, out.samples_segment, TRAIN_CFG)
    assert latest_version(store, "run") == 1  # the refused step published nothing
