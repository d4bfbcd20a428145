"""Served sessions in ``rollouts`` (issue 26 §4): ``gyre run --from-served`` gives every
scored session of a ``gyre serve`` run it takes a ``rollouts`` row, its reward the
aggregation of its scores, so README's worst-session queries answer on a serve store as on
a ``gyre run``'s; a pass that trains nothing (equal rewards) uses none of them up.

Fast: the store is written as ``gyre serve`` leaves it (the tiny model as v0, calls in
``tito``, scores posted, the session journal); the step trains the tiny model on CPU."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from tokenizers import Tokenizer

from flows.config import load_config
from flows.served import ServedError, pending_sessions, train_served
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.sessions import SessionTable
from storage.checkpoints import publish_checkpoint
from storage.paths import spool_dir
from storage.schemas import TITO_SCHEMA
from storage.sql import query
from storage.store import Store

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


def _serve_store(tmp_path, sessions: dict[str, tuple[str, float | None]]) -> Store:
    """What `gyre serve` leaves: v0, one call per session (prompt -> answer), the scores
    posted for it (None: not scored), its group in the journal."""
    st = Store(str(tmp_path / "store"))
    model = make_tiny_model()
    publish_checkpoint(st, RUN, model, 0)
    tok = Tokenizer.from_file(f"{model}/tokenizer.json")
    journal = spool_dir(st.url, RUN) / "sessions.jsonl"
    journal.parent.mkdir(parents=True, exist_ok=True)
    table = SessionTable(str(journal))
    calls, scores = [], []
    for sid, (text, score) in sessions.items():
        table.new(sid, group_id="g")
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
            scores.append(
                {
                    "run_id": RUN,
                    "session_id": sid,
                    "subtask_id": "answer",
                    "score": score,
                    "weight": 1.0,
                    "at_request_id": None,
                    "source": "harness",
                    "status": "finished",
                    "reason": "",
                }
            )
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
