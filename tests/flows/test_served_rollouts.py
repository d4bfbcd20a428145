"""Served sessions in ``rollouts`` (issue 26 §4): ``gyre run --from-served`` gives every
scored session of a ``gyre serve`` run it takes a ``rollouts`` row, its reward the
aggregation of its scores, so README's worst-session queries answer on a serve store as on
a ``gyre run``'s; a pass that trains nothing (equal rewards) uses none of them up.

Fast: the store is written as ``gyre serve`` leaves it (the tiny model as v0, calls in
``tito``, scores posted, the session journal); the step trains the tiny model on CPU."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest
from tokenizers import Tokenizer

from flows.config import load_config
from flows.served import ServedError, _learnable, pending_sessions, train_served
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.sessions import SessionTable
from storage.checkpoints import publish_checkpoint
from storage.paths import spool_dir
from storage.schemas import TITO_SCHEMA
from storage.sql import query
from storage.store import Store
from tasks.process import process_sessions

RUN = "serve"
README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_worst_queries() -> list[str]:
    """README's worst-session queries (its transcript, its calls; a serve run's by its
    scores), as written there."""
    block = README.read_text().split("```sql\n", 1)[1].split("```", 1)[0]
    queries = [q.strip() for q in block.split(";") if q.strip()]
    keys = ("the worst session", "its calls one by one", "lowest-scored session")
    worst = [q for k in keys for q in queries if k in q]
    assert len(worst) == 3, worst
    return worst


def score_row(session_id: str, subtask: str, score: float) -> dict:
    """A finished harness score of ``session_id``'s ``subtask``, as the gateway records it."""
    return {
        "run_id": RUN,
        "session_id": session_id,
        "subtask_id": subtask,
        "score": score,
        "weight": 1.0,
        "at_request_id": None,
        "source": "harness",
        "status": "finished",
        "reason": "",
    }


def _serve_store(
    tmp_path, sessions: dict[str, tuple[str, float | None]], groups: dict[str, str] | None = None
) -> Store:
    """What `gyre serve` leaves: v0, one call per session (prompt -> answer), the scores
    posted for it (None: not scored), its group in the journal (``groups``; default "g")."""
    st = Store(str(tmp_path / "store"))
    model = make_tiny_model()
    publish_checkpoint(st, RUN, model, 0)
    tok = Tokenizer.from_file(f"{model}/tokenizer.json")
    journal = spool_dir(st.url, RUN) / "sessions.jsonl"
    journal.parent.mkdir(parents=True, exist_ok=True)
    table = SessionTable(str(journal))
    calls, scores = [], []
    for sid, (text, score) in sessions.items():
        table.new(sid, group_id=(groups or {}).get(sid, "g"))
        prompt = tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids
        out = tok.encode(f"answer to {text}<|im_end|>").ids
        calls.append(
            {
                "run_id": RUN,
                "session_id": sid,
                "request_id": f"{sid}-0",
                "seq_no": 0,
                "parent_request_id": None,
                "prefix_len": 0,
                "new_input_ids": prompt,
                "output_ids": out,
                "output_logprobs": [-1.0] * len(out),
                "weight_version": 0,
                "cell_id": "serve",
                "finish_reason": "stop",
                "cached_tokens": 0,
                "t_start": 0.0,
                "t_end": 1.0,
                "endpoint": "chat",
            }
        )
        if score is not None:
            scores.append(score_row(sid, "answer", score))
    st.append("tito", pa.Table.from_pylist(calls, schema=TITO_SCHEMA))
    st.append("scores", scores)
    return st


def _cfg():
    return load_config(overrides=["train.lr=0.01"])


def test_scored_served_sessions_get_rollouts_rows_and_readme_finds_the_worst(tmp_path):
    st = _serve_store(
        tmp_path, {"good": ("2 + 2?", 1.0), "bad": ("3 + 5?", 0.0), "later": ("hello", None)}
    )
    transcript, calls, by_scores = _readme_worst_queries()
    assert query(st, transcript).num_rows == 0  # served, scored, not trained yet: no rows
    (low,) = query(st, by_scores).to_pylist()  # the query for a serve run answers already
    assert low["session_id"] == "bad" and low["score"] == 0.0 and "3 + 5?" in low["text"]
    out = train_served(st, RUN, _cfg(), say=lambda m: None)
    assert out["samples"] == 2 and out["weight_version"] == 1
    rows = query(
        st, "SELECT session_id, group_id, status, reward, n_calls FROM rollouts ORDER BY 1"
    ).to_pylist()
    assert rows == [
        {"session_id": "bad", "group_id": "g", "status": "finished", "reward": 0.0, "n_calls": 1},
        {"session_id": "good", "group_id": "g", "status": "finished", "reward": 1.0, "n_calls": 1},
    ]  # the unscored session waits for its score (no row)
    (worst,) = query(st, transcript).to_pylist()
    assert worst["session_id"] == "bad" and worst["reward"] == 0.0
    assert "3 + 5?" in worst["text"] and "<|im_start|>assistant" in worst["text"]
    (call,) = query(st, calls).to_pylist()
    assert "3 + 5?" in call["input_text"] and call["output_text"] == "answer to 3 + 5?<|im_end|>"
    assert [s.session_id for s in pending_sessions(st, RUN)] == []  # "later" is unscored
    assert query(st, by_scores).to_pylist() == [low]


def test_a_pass_with_nothing_to_learn_uses_no_session_up(tmp_path):
    """Equal rewards in every group: the pass trains nothing and says to score sessions
    that differ; the sessions stay pending (no rows), so once they differ they train."""
    st = _serve_store(tmp_path, {"a": ("2 + 2?", 1.0), "b": ("3 + 5?", 1.0)})
    with pytest.raises(ServedError, match="equal rewards"):
        train_served(st, RUN, _cfg(), say=lambda m: None)
    for dataset in ("rollouts", "samples", "nodes", "steps"):
        assert st.read(dataset).num_rows == 0, dataset
    assert [s.session_id for s in pending_sessions(st, RUN)] == ["a", "b"]
    st.append(
        "scores",
        [
            {
                "run_id": RUN,
                "session_id": "b",
                "subtask_id": "style",
                "score": 0.0,
                "weight": 1.0,
                "at_request_id": None,
                "source": "harness",
                "status": "finished",
                "reason": "",
            }
        ],
    )
    assert train_served(st, RUN, _cfg(), say=lambda m: None)["samples"] == 2
    got = query(st, "SELECT session_id, reward FROM rollouts ORDER BY 1").to_pylist()
    assert got == [{"session_id": "a", "reward": 1.0}, {"session_id": "b", "reward": 0.5}]


def _scores(session_id: str, score: float) -> list[dict]:
    return [score_row(session_id, "answer", score)]


def _process(st: Store, step: int) -> set[str]:
    """What a pass does with the sessions it takes (their ``rollouts`` rows, samples), as
    `train_served` processes them; the sessions it took."""
    sessions = pending_sessions(st, RUN)
    process_sessions(st, RUN, step, sessions, current_version=0)
    return {s.session_id for s in sessions}


def test_a_later_pass_takes_only_the_sessions_no_pass_used(tmp_path):
    """Sessions an earlier pass used (it gave them ``rollouts`` rows) are never taken
    again, so never trained twice; sessions scored since are; a row of another run is not
    this run's use. Selection only: no model is trained."""
    st = _serve_store(
        tmp_path,
        {"s1": ("2 + 2?", 1.0), "s2": ("3 + 5?", 0.0), "s3": ("1 + 1?", None), "s4": ("hi", None)},
    )
    assert _process(st, 0) == {"s1", "s2"}  # s3 and s4 wait for their scores
    assert pending_sessions(st, RUN) == []
    st.append("scores", _scores("s3", 1.0) + _scores("s4", 0.0))
    other = st.read("rollouts").to_pylist()[0]  # s1's row, as another run's
    st.append("rollouts", [{**other, "run_id": "other", "session_id": "s3"}])
    assert [s.session_id for s in pending_sessions(st, RUN)] == ["s3", "s4"]
    assert _process(st, 1) == {"s3", "s4"}
    assert pending_sessions(st, RUN) == []
    rows = query(st, f"SELECT session_id FROM rollouts WHERE run_id = '{RUN}'").to_pylist()
    assert sorted(r["session_id"] for r in rows) == ["s1", "s2", "s3", "s4"]  # once each


def test_sessions_are_grouped_by_their_recorded_groups_for_the_advantage(tmp_path):
    """Each session's group is the one its serve journal recorded: the advantage compares
    it with its own group only. Group x (rewards 1, 0) teaches; group y (1, 1) ties and
    is skipped; one group of all four (mean 0.75) would give every session an advantage."""
    rewards = {"x1": 1.0, "x2": 0.0, "y1": 1.0, "y2": 1.0}
    st = _serve_store(
        tmp_path,
        {sid: (f"question {sid}", r) for sid, r in rewards.items()},
        groups={"x1": "x", "x2": "x", "y1": "y", "y2": "y"},
    )
    sessions = pending_sessions(st, RUN)
    assert {s.session_id: s.group_id for s in sessions} == {
        "x1": "x", "x2": "x", "y1": "y", "y2": "y"
    }  # fmt: skip
    done = process_sessions(st, RUN, 0, sessions, current_version=0)
    assert done.zero_variance_groups == 1
    samples = {r["session_id"]: r for r in st.read("samples").to_pylist()}
    assert set(samples) == {"x1", "x2"}, sorted(samples)
    assert {r["group_id"] for r in samples.values()} == {"x"}
    up, down = samples["x1"], samples["x2"]
    assert max(up["weight_pos"]) > 0 and min(up["weight_neg"]) == 0  # above its group
    assert min(down["weight_neg"]) < 0 and max(down["weight_pos"]) == 0  # below it


def test_groups_that_each_tie_are_nothing_to_learn_though_all_together_differ(tmp_path):
    """Group x ties at 1, group y at 0: within each group nothing differs, so there is
    nothing to learn (`train_served` refuses before it writes anything); the same four
    sessions as one group would differ."""
    st = _serve_store(
        tmp_path,
        {"x1": ("a", 1.0), "x2": ("b", 1.0), "y1": ("c", 0.0), "y2": ("d", 0.0)},
        groups={"x1": "x", "x2": "x", "y1": "y", "y2": "y"},
    )
    sessions = pending_sessions(st, RUN)
    assert not _learnable(st, RUN, sessions, _cfg())
    one = [replace(s, group_id="all") for s in sessions]
    assert _learnable(st, RUN, one, _cfg())
