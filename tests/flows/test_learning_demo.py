"""A shortened demo learns: its held-out reward beats a frozen-weights control's.

``gyre run --preset demo`` cut to 30 steps (the command a user runs, as a subprocess), and
the same command with ``train.lr=1e-12`` (weights frozen in effect; same tasks, sampling
and held-out seeds). The demo's held-out reward after training must exceed the control's by
more than the control's own movement plus two standard errors of the demo's held-out mean
(over its 32 held-out tasks). In our runs the gain at step 30 was +0.13 to +0.21 with a
standard error of about 0.04 (BENCHMARKS.md, "Learning: RL on top of the warm start").

The control is evaluated before and after ONE step, as bench/learning.py's SmolLM2 control:
weights frozen in effect (lr 1e-12) are the same after one step as after 30, so its "after"
is what 30 would give, without 29 steps that train nothing.

About 3 minutes on 2 cores (plus ~100 s the first time, for the warm start): slow suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]


def _run(store: Path, run_id: str, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "flows.cli", "run", "--preset", "demo", "--store", str(store)]
    cmd += [f"run_id={run_id}", "train.steps=30", "eval.every=30", *extra]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((store / "runs" / run_id / "summary.json").read_text())


def test_a_shortened_demo_beats_its_frozen_control(tmp_path: Path):
    demo = _run(tmp_path, "demo")
    control = _run(tmp_path, "control", "train.lr=1e-12", "train.steps=1", "eval.every=1")
    assert demo["reward_before"] == pytest.approx(control["reward_before"])  # same start
    control_moved = abs(control["reward_after"] - control["reward_before"])
    se = demo["learning"]["reward_after_se"]
    margin = demo["reward_after"] - control["reward_after"]
    assert margin > control_moved + 2 * se, (demo["curve"], control["curve"], se)
