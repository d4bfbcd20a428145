"""Held-out evaluation in a real run: Prefect flow, LocalCluster cells, engines, gateway.

A short run of the ``tools`` suite from a (very short) warm start, evaluated before the first
step and after every step. Checked through what a user sees (the ``evals`` view, ``tito``,
``samples``, ``summary.json``, the curve PNG):

- every evaluated version has one row per held-out seed, and those seeds are not the ones
  training drew;
- every call of an evaluation session was answered by exactly the version it evaluates (the
  cell is pinned while it runs);
- evaluation sessions are never trained on (not in ``samples``, hence not in ``ledger``);
- the run's summary carries ``reward_before``/``reward_after`` and the curve, and
  ``summary.json`` and ``learning.png`` are in the run directory.
"""

from __future__ import annotations

import json

import pytest

from storage.sql import query
from storage.store import Store
from tasks.env.heldout import EVAL_SEED0

pytestmark = pytest.mark.integration


def test_a_run_evaluates_held_out_tasks_on_pinned_versions(tmp_path, monkeypatch, prefect_harness):
    from flows.rl_run import rl_run

    monkeypatch.setenv("GYRE_CACHE", str(tmp_path / "cache"))  # the warm start is built here
    store_url = str(tmp_path / "store")
    summary = rl_run(
        preset="tiny",
        store=store_url,
        run_id="held",
        overrides=[
            "rollout.suite=tools",
            "rollout.difficulty=0",
            "rollout.subtasks=1",
            "rollout.group_size=2",
            "rollout.max_new_tokens=24",
            "warmstart.enabled=true",
            "warmstart.steps=2",
            "warmstart.demos=4",
            "warmstart.batch_size=2",
            "train.steps=2",
            "eval.every=1",
            "eval.tasks=3",
        ],
    )
    st = Store(store_url)
    assert any((tmp_path / "cache" / "warmstart").glob("tools-d0-*"))  # the run's warm start
    rows = query(
        st, "SELECT version, step, seed, session_id, reward FROM evals ORDER BY version, seed"
    ).to_pylist()
    by_v: dict[int, list[dict]] = {}
    for r in rows:
        by_v.setdefault(r["version"], []).append(r)
    assert sorted(by_v) == [0, 1, 2], rows
    for v, rs in by_v.items():
        assert [r["seed"] for r in rs] == [EVAL_SEED0, EVAL_SEED0 + 1, EVAL_SEED0 + 2]
        assert {r["step"] for r in rs} == {v}
        assert all(0.0 <= r["reward"] <= 1.0 for r in rs)
    # each evaluation session was served by exactly the version it evaluates
    served = query(
        st,
        "SELECT e.version, list(DISTINCT t.weight_version) AS served, count(*) AS calls "
        "FROM evals e JOIN tito t USING (session_id) GROUP BY 1 ORDER BY 1",
    ).to_pylist()
    assert [(s["version"], s["served"]) for s in served] == [(0, [0]), (1, [1]), (2, [2])]
    assert all(s["calls"] >= 3 for s in served)
    # never trained on
    leaked = query(
        st, "SELECT count(*) AS n FROM samples WHERE session_id IN (SELECT session_id FROM evals)"
    ).to_pylist()
    assert leaked == [{"n": 0}]
    trained = query(st, "SELECT count(*) AS n FROM samples").to_pylist()
    assert trained[0]["n"] > 0
    # what the run reports
    assert summary["eval_tasks"] == 3
    mean = {v: sum(r["reward"] for r in rs) / len(rs) for v, rs in by_v.items()}
    assert summary["reward_before"] == pytest.approx(mean[0])
    assert summary["reward_after"] == pytest.approx(mean[2])
    assert summary["curve"].startswith("0:") and " 2:" in summary["curve"]
    saved = json.loads(st.read_bytes("runs/held/summary.json"))
    assert saved["reward_after"] == pytest.approx(mean[2]) and saved["steps"] == 2
    assert st.read_bytes("runs/held/learning.png")[:4] == b"\x89PNG"
