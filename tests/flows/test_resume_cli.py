"""``gyre run --resume`` of a run the store does not hold: refused before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_resume_of_a_missing_run_is_refused(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--resume", "nope", "--store", str(store)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert out.returncode == 2, out.stderr
    assert "no run 'nope' to continue" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (store / "checkpoints").exists()  # nothing started, nothing written
