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

import pytest

from flows.config import load_config
from flows.served import _learnable, pending_sessions, train_served
from storage.sql import query
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
