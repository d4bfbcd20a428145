"""What ``gyre run --from-served`` asks and returns (flows/served.py), pinned where generated
mutants survived the fast suite (bench/mutation.py, issue 26):

- ``_learnable`` computes each session's reward as processing does: a session's declared
  sub-tasks count (one it never scored gives 0), and the configured advantage decides
  whether a group has anything to learn (``per_subtask``: sub-tasks that differ teach even
  when the aggregated rewards tie).
- ``train_served`` processes under the step it trains (the ``rollouts`` rows carry it) and
  returns the step's loss under ``loss``.

Fast: the store as ``gyre serve`` leaves it (tests/flows/test_served_rollouts.py builds it);
one step of the tiny model on CPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flows import served
from flows.config import load_config
from flows.served import ServedError, _learnable, next_step, pending_sessions, train_served
from storage.lease import Lease, LeaseHeld
from storage.paths import spool_dir
from storage.sql import query
from storage.store import Store
from tasks.handles import SessionHandle
from tests.flows.test_served_rollouts import RUN, _serve_store
from tests.flows.test_served_rollouts import score_row as _score


def _cfg(*overrides: str):
    return load_config(overrides=["train.lr=0.01", *overrides])


def test_learnable_counts_a_declared_subtask_that_was_never_scored(tmp_path):
    """Both sessions scored 1.0 on ``answer``; ``b`` also on ``style``. Undeclared, both
    rewards are 1.0 (nothing to learn); with ``answer`` and ``style`` declared, ``a``'s
    missing ``style`` scores 0 (reward 0.5 against 1.0): processing would learn, so must
    the check."""
    st = _serve_store(tmp_path, {"a": ("2 + 2?", 1.0), "b": ("3 + 5?", 1.0)})
    st.append("scores", [_score("b", "style", 1.0)])
    plain = pending_sessions(st, RUN)
    assert not _learnable(st, RUN, plain, _cfg())
    declared = [
        SessionHandle(s.session_id, s.group_id, s.task_id, s.step, s.status,
                      {"answer": 1.0, "style": 1.0}, s.reason)
        for s in plain
    ]  # fmt: skip
    assert _learnable(st, RUN, declared, _cfg())


def test_learnable_follows_the_configured_advantage(tmp_path):
    """``a`` answered right and styled wrong, ``b`` the other way: equal rewards (0.5), so
    GRPO has nothing to learn, while per-sub-task credit has (each sub-task differs)."""
    st = _serve_store(tmp_path, {"a": ("2 + 2?", 1.0), "b": ("3 + 5?", 0.0)})
    st.append("scores", [_score("a", "style", 0.0), _score("b", "style", 1.0)])
    sessions = pending_sessions(st, RUN)
    assert not _learnable(st, RUN, sessions, _cfg("train.advantage=grpo"))
    assert _learnable(st, RUN, sessions, _cfg("train.advantage=per_subtask"))


def test_train_served_processes_under_its_step_and_returns_its_loss(tmp_path):
    st = _serve_store(tmp_path, {"good": ("2 + 2?", 1.0), "bad": ("3 + 5?", 0.0)})
    out = train_served(st, RUN, _cfg(), say=lambda m: None)
    assert out["step"] == 0
    steps = query(st, f"SELECT step, loss FROM steps WHERE run_id = '{RUN}'").to_pylist()
    assert len(steps) == 1 and steps[0]["step"] == 0
    assert "loss" in out and out["loss"] is not None
    assert out["loss"] == pytest.approx(steps[0]["loss"])
    rows = query(st, f"SELECT DISTINCT step FROM rollouts WHERE run_id = '{RUN}'").to_pylist()
    assert rows == [{"step": 0}], rows


def test_the_next_step_follows_this_runs_steps_only(tmp_path):
    st = _serve_store(tmp_path, {})
    assert next_step(st, RUN) == 0  # no steps at all
    st.append("steps", [{"run_id": "other", "step": 7}])
    assert next_step(st, RUN) == 0  # another run's steps do not count
    st.append("steps", [{"run_id": RUN, "step": 0}, {"run_id": RUN, "step": 2}])
    st.append("steps", [{"run_id": RUN, "step": 1}])
    assert next_step(st, RUN) == 3 and next_step(st, "other") == 8


def test_a_later_pass_trains_the_next_step(tmp_path):
    st = _serve_store(tmp_path, {"good": ("2 + 2?", 1.0), "bad": ("3 + 5?", 0.0)})
    st.append("steps", [{"run_id": RUN, "step": 0, "weight_version": 0},
                        {"run_id": "other", "step": 9, "weight_version": 4}])  # fmt: skip
    out = train_served(st, RUN, _cfg(), say=lambda m: None)
    assert out["step"] == 1
    rows = query(st, f"SELECT DISTINCT step FROM rollouts WHERE run_id = '{RUN}'").to_pylist()
    assert rows == [{"step": 1}]


def test_a_pass_holds_the_runs_lease_under_its_own_name(tmp_path, monkeypatch):
    """While a pass runs, anyone else asking for the run's lease is told who holds it."""
    st = _serve_store(tmp_path, {"a": ("2 + 2?", 1.0)})
    told = []

    def latest(store, run_id):  # the pass's first look inside its lease
        with pytest.raises(LeaseHeld) as got:
            Lease(store, run_id, "someone else").acquire()
        told.append(str(got.value))
        return None

    monkeypatch.setattr(served, "latest_version", latest)
    with pytest.raises(ServedError):
        train_served(st, RUN, _cfg(), say=lambda m: None)
    assert len(told) == 1 and "is in use by gyre run --from-served (pid" in told[0]


def test_what_a_pass_says_when_it_cannot_train(tmp_path):
    empty = Store(str(tmp_path / "empty"))
    with pytest.raises(ServedError) as got:
        train_served(empty, RUN, _cfg(), say=lambda m: None)
    assert str(got.value) == (
        f"run 'serve' has no checkpoint in {empty.url}: serve it once with this gyre (`gyre"
        " serve` publishes the served model as v0), or publish one"
    )
    st = _serve_store(tmp_path, {"a": ("2 + 2?", None)})  # a call, no score
    with pytest.raises(ServedError) as got:
        train_served(st, RUN, _cfg(), say=lambda m: None)
    assert str(got.value) == (
        f"no scored session of run 'serve' waits for training in {st.url}: score sessions"
        " with POST /gyre/scores (README: serve, score, train), and stop `gyre serve` so"
        " that its last calls are flushed"
    )
    tie = _serve_store(tmp_path / "tie", {"a": ("2 + 2?", 1.0), "b": ("3 + 5?", 1.0)})
    with pytest.raises(ServedError) as got:
        train_served(tie, RUN, _cfg(), say=lambda m: None)
    assert str(got.value).startswith("the 2 sessions have equal rewards within each group")


def test_a_pass_trains_on_its_own_samples_and_reports_them(tmp_path):
    st = _serve_store(tmp_path, {"good": ("2 + 2?", 1.0), "bad": ("3 + 5?", 0.0)})
    said = []
    out = train_served(st, RUN, _cfg(), say=said.append)
    samples = query(st, f"SELECT count(*) AS n FROM samples WHERE run_id = '{RUN}'").to_pylist()
    n = samples[0]["n"]
    assert n > 0
    assert said == [f"2 scored sessions (2 calls), mean reward 0.500: {n} samples"]
    row = query(
        st, f"SELECT step, n_samples, trainable_tokens, cells FROM steps WHERE run_id = '{RUN}'"
    ).to_pylist()
    assert row == [{"step": 0, "n_samples": n, "trainable_tokens": row[0]["trainable_tokens"],
                    "cells": ["local"]}]  # fmt: skip
    assert row[0]["trainable_tokens"] > 0  # the pass's samples were trained on, not none
    assert out == {
        "run_id": RUN,
        "store": st.url,
        "step": 0,
        "weight_version": 1,
        "sessions": 2,
        "samples": n,
        "loss": out["loss"],
        "checkpoint": f"{st.url}/checkpoints/{RUN}/v1",
    }
    rows = query(
        st, f"SELECT session_id, group_id, task_id, status, reason FROM rollouts"
        f" WHERE run_id = '{RUN}' ORDER BY 1"
    ).to_pylist()  # fmt: skip
    assert rows == [
        {"session_id": s, "group_id": "g", "task_id": s, "status": "finished", "reason": "served"}
        for s in ("bad", "good")
    ]


def test_a_session_the_journal_does_not_know_is_in_the_unnamed_group(tmp_path):
    st = _serve_store(tmp_path, {"a": ("2 + 2?", 1.0), "b": ("3 + 5?", 0.0)})
    (spool_dir(st.url, RUN) / "sessions.jsonl").unlink()  # another machine's serve
    assert [(s.session_id, s.group_id) for s in pending_sessions(st, RUN)] == [("a", ""), ("b", "")]


def test_a_pass_processes_with_the_configured_aggregation_and_normalisation(tmp_path):
    """``good`` scored (1.0, 0.5) and ``bad`` (0.0, 0.0) on two sub-tasks: under ``min`` their
    rewards are 0.5 and 0.0 (weighted mean: 0.75); GRPO's advantage over the population std
    of (0.5, 0.0) is +-1, without the std +-0.25."""
    for norm, adv in (("true", 1.0), ("false", 0.25)):
        st = _serve_store(tmp_path / norm, {"good": ("2 + 2?", 1.0), "bad": ("3 + 5?", 0.0)})
        st.append("scores", [_score("good", "style", 0.5), _score("bad", "style", 0.0)])
        cfg = _cfg("train.reward_aggregation=min", f"train.normalize_std={norm}")
        train_served(st, RUN, cfg, say=lambda m: None)
        got = query(st, "SELECT session_id, reward FROM rollouts ORDER BY 1").to_pylist()
        assert got == [{"session_id": "bad", "reward": 0.0}, {"session_id": "good", "reward": 0.5}]
        w = query(
            st, "SELECT session_id, list_max(weight_pos) AS hi, list_min(weight_neg) AS lo"
            " FROM samples ORDER BY 1"
        ).to_pylist()  # fmt: skip
        good = max(r["hi"] for r in w if r["session_id"] == "good")  # weight_pos: A > 0
        bad = min(r["lo"] for r in w if r["session_id"] == "bad")  # weight_neg: A < 0
        assert good == pytest.approx(adv, rel=1e-3) and bad == pytest.approx(-adv, rel=1e-3), w


def test_learnable_uses_the_configured_aggregation_and_only_this_runs_scores(tmp_path):
    """``a`` (1.0, 0.5) and ``b`` (0.5, 0.5): equal under ``min`` (0.5 each), not under the
    weighted mean (0.75, 0.5). Another run's score for ``b`` never counts here."""
    st = _serve_store(tmp_path, {"a": ("2 + 2?", 1.0), "b": ("3 + 5?", 0.5)})
    st.append("scores", [_score("a", "style", 0.5), _score("b", "style", 0.5)])
    sessions = pending_sessions(st, RUN)
    assert _learnable(st, RUN, sessions, _cfg())
    assert not _learnable(st, RUN, sessions, _cfg("train.reward_aggregation=min"))
    tie = _serve_store(tmp_path / "tie", {"a": ("2 + 2?", 1.0), "b": ("3 + 5?", 1.0)})
    tie.append("scores", [{**_score("b", "answer", 0.0), "run_id": "another run"}])
    assert not _learnable(tie, RUN, pending_sessions(tie, RUN), _cfg())


def test_a_pass_whose_processing_yields_no_samples_says_so(tmp_path, monkeypatch):
    st = _serve_store(tmp_path, {"a": ("2 + 2?", 1.0), "b": ("3 + 5?", 0.0)})
    import tasks.process

    def none(*a, **k):
        return SimpleNamespace(n_calls=2, reward_mean=0.5, n_samples=0, samples_segment=None)

    monkeypatch.setattr(tasks.process, "process_sessions", none)
    with pytest.raises(ServedError) as got:
        train_served(st, RUN, _cfg(), say=lambda m: None)
    assert str(got.value).startswith("the 2 sessions have equal rewards within each group")
    assert st.read("steps").num_rows == 0


def test_a_pass_processes_with_the_configured_advantage(tmp_path):
    """``a`` right and badly styled, ``b`` the other way: GRPO would learn nothing (0.5 each),
    per-sub-task credit learns each sub-task, so the pass trains."""
    st = _serve_store(tmp_path, {"a": ("2 + 2?", 1.0), "b": ("3 + 5?", 0.0)})
    st.append("scores", [_score("a", "style", 0.0), _score("b", "style", 1.0)])
    out = train_served(st, RUN, _cfg("train.advantage=per_subtask"), say=lambda m: None)
    assert out["samples"] > 0 and out["weight_version"] == 1
