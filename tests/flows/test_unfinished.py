"""Sessions a run leaves in flight get a ``rollouts`` row of status ``unfinished``
(flows/unfinished.py, issue 26 §3): their calls stay in ``tito`` and SQL tells them apart;
they have no reward, so nothing trains on them (``--from-served``, ``gyre export``)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from flows.export import branch_rows
from flows.served import pending_sessions
from flows.unfinished import IN_FLIGHT, mark_unfinished
from infra.gateway.sessions import SessionTable
from storage.schemas import TITO_SCHEMA
from storage.sql import query
from storage.store import Store

RUN = "r1"


def _call(sid, seq, new, out, prefix=0, run_id=RUN):
    return {
        "run_id": run_id, "session_id": sid, "request_id": f"{sid}-{seq}", "seq_no": seq,
        "parent_request_id": f"{sid}-{seq - 1}" if seq else None, "prefix_len": prefix,
        "new_input_ids": new, "output_ids": out, "output_logprobs": [-0.5] * len(out),
        "weight_version": 0, "cell_id": "c0", "finish_reason": "stop", "cached_tokens": 0,
        "t_start": float(seq), "t_end": seq + 0.5, "endpoint": "chat",
    }  # fmt: skip


def _rollout(sid, reward, status="finished", group="g0"):
    return {
        "run_id": RUN, "session_id": sid, "group_id": group, "step": 0, "task_id": "t0",
        "status": status, "reward": reward, "n_calls": 1, "n_tokens_unique": 5,
        "n_tokens_flat": 5, "reason": "", "parent_session_id": None,
    }  # fmt: skip


def _score(sid, status):
    return {
        "run_id": RUN, "session_id": sid, "subtask_id": "q0", "score": 1.0, "weight": 1.0,
        "at_request_id": None, "source": "env", "status": status, "reason": "",
    }  # fmt: skip


def _store(tmp_path):
    """Run r1's gateway minted six sessions: a0 and a1 (group g0) were processed; b (g1)
    had two calls when the run ended; c (g1) ended (scored) but its group was never
    processed; d (g2) was minted but made no call; e is a held-out evaluation's."""
    st = Store(str(tmp_path / "store"))
    journal = tmp_path / "sessions.jsonl"
    table = SessionTable(str(journal))
    for sid, gid, meta in [
        ("a0", "g0", {"step": 0, "task_id": "t0"}),
        ("a1", "g0", {"step": 0, "task_id": "t0"}),
        ("b", "g1", {"step": 1, "task_id": "t1"}),
        ("c", "g1", {"step": 1, "task_id": "t1"}),
        ("d", "g2", {"step": 1, "task_id": "t2"}),
        ("e", "eval-v0", {"eval": True, "version": 0, "task_id": "t9"}),
    ]:
        table.new(sid, group_id=gid, meta=meta)
    calls = [
        _call("a0", 0, [1, 2, 3], [4, 5]),
        _call("a1", 0, [1, 2, 3], [6, 7]),
        _call("b", 0, [1, 2, 3], [4, 5]),
        _call("b", 1, [6], [7, 8], prefix=5),  # extends call 0's 3 + 2 tokens
        _call("c", 0, [1, 2], [9]),
        _call("e", 0, [1], [2]),
        _call("b", 0, [1], [2], run_id="other"),  # another run's session of the same name
    ]
    st.append("tito", pa.Table.from_pylist(calls, schema=TITO_SCHEMA))
    st.append("rollouts", [_rollout("a0", 1.0), _rollout("a1", 0.0)])
    st.append("scores", [_score("a0", "finished"), _score("a1", "finished")])
    st.append("scores", [_score("c", "timeout")])
    st.append("evals", [{"run_id": RUN, "version": 0, "step": 0, "session_id": "e"}])
    return st, journal


def test_sessions_left_in_flight_get_unfinished_rows_once(tmp_path):
    st, journal = _store(tmp_path)
    assert mark_unfinished(st, RUN, journal) == 3
    rows = query(
        st,
        "SELECT session_id, group_id, step, task_id, status, reward, n_calls, "
        "n_tokens_unique, n_tokens_flat, reason FROM rollouts WHERE status = 'unfinished' "
        "ORDER BY session_id",
    ).to_pylist()
    assert [(r["session_id"], r["group_id"], r["step"], r["task_id"]) for r in rows] == [
        ("b", "g1", 1, "t1"),
        ("c", "g1", 1, "t1"),
        ("d", "g2", 1, "t2"),
    ]
    assert all(r["status"] == "unfinished" and r["reward"] is None for r in rows)
    # b: 3 + 2 + 1 + 2 unique tokens; flat 5 (call 0) + 5 + 1 + 2 (call 1's whole context)
    assert [(r["n_calls"], r["n_tokens_unique"], r["n_tokens_flat"]) for r in rows] == [
        (2, 8, 13),
        (1, 3, 3),
        (0, 0, 0),
    ]
    assert rows[0]["reason"] == rows[2]["reason"] == IN_FLIGHT
    assert rows[1]["reason"].startswith("the session ended (timeout) but the run ended before")
    # the evaluation's session keeps its row in `evals`; the processed ones keep theirs
    assert query(st, "SELECT count(*) AS n FROM rollouts").to_pylist() == [{"n": 5}]
    # a second close (the run that resumes this one) writes nothing more
    assert mark_unfinished(st, RUN, journal) == 0
    dup = "SELECT session_id FROM rollouts GROUP BY 1 HAVING count(*) > 1"
    assert query(st, dup).to_pylist() == []
    # every session with calls in tito now has a row (SQL tells in-flight ones apart)
    orphans = query(
        st,
        "SELECT DISTINCT t.session_id FROM tito t ANTI JOIN rollouts r USING (run_id, "
        f"session_id) WHERE t.run_id = '{RUN}'",
    ).to_pylist()
    assert orphans == [{"session_id": "e"}]


def test_unfinished_sessions_are_never_trained_on(tmp_path):
    st, journal = _store(tmp_path)
    # before: c (scored, in tito, no row) would be taken as a served session to train on
    assert [s.session_id for s in pending_sessions(st, RUN)] == ["c"]
    mark_unfinished(st, RUN, journal)
    assert pending_sessions(st, RUN) == []
    # the mean reward skips them (null), as the run summary and learning curve compute it
    got = query(st, f"SELECT avg(reward) AS r FROM rollouts WHERE run_id = '{RUN}'").to_pylist()
    assert got == [{"r": 0.5}]
    # the exported dataset has the processed sessions' branches only, none without a reward
    rows = branch_rows(st, RUN)
    assert sorted(r["session_id"] for r in rows) == ["a0", "a1"]
    # rewards 1 and 0: +-0.5 over their std 0.5 (+ the sampler's eps 1e-6)
    assert sorted(r["advantage"] for r in rows) == pytest.approx([-1.0, 1.0], abs=1e-5)
    assert all(r["step"] == 0 for r in rows)


def test_no_journal_or_nothing_left_writes_nothing(tmp_path):
    st = Store(str(tmp_path / "store"))
    assert mark_unfinished(st, RUN, tmp_path / "none.jsonl") == 0
    assert st.read("rollouts").num_rows == 0
