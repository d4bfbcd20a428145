"""A broken agent stops the run: more than ``rollout.max_failed_fraction`` of a step's
sessions failed is an error naming the first reasons, never a "successful" run that trained
on nothing (issue 15: a ``cmd:`` agent sending a wrong model name exited 0).

The tally by hand (``FailedSessions``), and a real ``gyre run`` with such an agent.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from storage.sql import query
from storage.store import Store
from tasks.env.config import RolloutConfig
from tasks.handles import SessionHandle
from tasks.rollout import FailedSessions, RolloutsFailed

ROOT = Path(__file__).resolve().parents[2]


def _h(step: int, status: str, reason: str = "") -> SessionHandle:
    return SessionHandle(f"s{step}-{status}-{reason}", "g", "t", step, status, reason=reason)


def test_a_step_stops_when_more_than_the_fraction_of_its_sessions_fail():
    cfg = RolloutConfig(groups_per_step=2, group_size=2, max_failed_fraction=0.5)
    tally = FailedSessions(cfg)  # 4 sessions a step: 3 failures pass the bound, 2 do not
    tally.add([_h(0, "failed", "boom"), _h(0, "finished")])
    tally.add([_h(0, "failed", "boom"), _h(0, "timeout", "slow")])  # a timeout is no failure
    tally.add([_h(1, "failed", "a"), _h(1, "failed", "b")])  # another step's count
    assert (tally.n_failed, tally.n_sessions) == (4, 6)
    tally.check()  # 2 of 4 in each step: not more than half
    tally.add([_h(1, "failed", "c")])
    with pytest.raises(RolloutsFailed) as err:
        tally.check()
    msg = str(err.value)
    assert "step 1: 3 of its 4 sessions failed" in msg
    assert "'a'; 'b'; 'c'" in msg and "rollout.max_failed_fraction=0.5" in msg
    never = FailedSessions(RolloutConfig(group_size=2, max_failed_fraction=1.0))
    never.add([_h(0, "failed", "x"), _h(0, "failed", "y")])
    never.check()  # 1 = never stop for failures


@pytest.mark.integration
@pytest.mark.slow  # a whole `gyre run` (its own Prefect server, cells, engine): ~1 minute
def test_a_run_whose_agent_asks_for_a_wrong_model_fails_naming_the_reason(tmp_path):
    store = tmp_path / "store"
    agent = Path(__file__).with_name("wrong_model_agent.py")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)  # the run starts its own temporary server
    env.pop("TQDM_DISABLE", None)  # the progress line, as a user sees it
    args = ["run", "--preset", "tiny", "--store", str(store), "run_id=broken"]
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args, f"rollout.harness=cmd:{sys.executable} {agent}"],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        cwd=ROOT,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    last = out.stderr.strip().splitlines()[-1]  # one line, not a traceback, ends the run
    # the first step's group or the second's (two are admitted at once) fails first
    assert re.match(r"gyre run: step [01]: ", last) and "max_failed_fraction=0.5" in last, last
    assert "gpt-no-such-model" in last, last  # the agent's last words, not a traceback's middle
    assert "gpt-no-such-model" in text, text[-3000:]  # the first reason: the 404 for it
    # the progress line counts the run's failed sessions so far (a second group may have
    # started before the first one's failures stopped the run: 4/4 or 8/8)
    assert re.search(r"failed [1-9]\d*/\d+ sessions", out.stderr), out.stderr[-3000:]
    rows = query(
        Store(str(store)),
        "SELECT status, reason FROM rollouts WHERE run_id = 'broken'",
    ).to_pylist()
    # a group started after the first one's failures stopped the run: in flight, unfinished
    rows = [r for r in rows if r["status"] != "unfinished"]
    assert rows and all(r["status"] == "failed" for r in rows), rows
    assert all("gpt-no-such-model" in r["reason"] for r in rows)
    steps = query(Store(str(store)), "SELECT count(*) AS n FROM steps").to_pylist()
    assert steps[0]["n"] == 0  # nothing trained on nothing
