"""bench/modes.py end to end: every mode live on paced cells beside the simulator's prediction
of the same run (same workload file, sizes, seed and policy). Slow (minutes): ``-m slow``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GROWTH = ROOT / "bench" / "workloads" / "growth.yaml"


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.integration
def test_quick_bench_live_agrees_with_the_simulator(tmp_path):
    out = tmp_path / "modes.json"
    cmd = [sys.executable, str(ROOT / "bench" / "modes.py"), "--quick", "--json", str(out)]
    cmd += ["--workload", str(GROWTH), "--store", str(tmp_path / "store")]
    env = {**os.environ, "GYRE_BENCH_SPOOL": str(tmp_path / "spool"), "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-4000:]
    fig = json.loads(out.read_text())
    ratios = {m: v["live_over_sim"] for m, v in fig["by_mode"].items()}
    # loose: the live stack has costs the simulator does not (Prefect, processing, a loaded
    # machine); a ratio far outside this band means they no longer model the same run
    assert all(0.6 <= x <= 1.6 for x in ratios.values()), ratios
    assert fig["failed_calls"] == 0 and fig["ledger_duplicates"] == 0
    assert {"colocate", "elastic"} <= set(fig["by_mode"])
    assert fig["lag_max_elastic"] <= 1 and fig["lag_max_async"] <= 1  # the one lag bound
