"""bench/smoke.py cuts a ``gyre run --preset tiny``'s stamped output into its phases at the
lines the run prints anyway (the real run end to end: ``python bench/smoke.py --quick``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import smoke

LINES = [
    (1.2, "gyre run: run-x preset=tiny store=/tmp/s steps=2 (starting Prefect, cells, ...)"),
    (
        14.6,
        "12:00:01.0 | INFO | Flow run 'run-x | tiny' - Beginning flow run 'run-x | tiny' "
        "for flow 'rl_run'",
    ),
    (23.5, "12:00:10.0 | INFO | Flow run 'run-x | tiny' - cells and gateway up in 8.9s"),
    (30.0, "12:00:16.0 | INFO | Flow run 'run-x-schedule' - Beginning subflow run"),
    (
        46.2,
        "12:00:32.0 | INFO | Flow run 'run-x-schedule' - elastic: 2 cells (cell-a=rollout, "
        "cell-b=rollout), 1 groups of 4 per step",
    ),
    (60.0, "12:00:46.0 | INFO | Task run 'rollout-g0' - group g0: 4 sessions, 16 calls in 4s"),
    (87.5, "12:01:13.0 | INFO | Flow run 'run-x-schedule' - elastic: 2 steps in 41.3s; 1 switches"),
    (108.1, "12:01:34.0 | INFO | Flow run 'run-x | tiny' - summary: {'run_id': 'run-x'}"),
    (108.2, "run summary"),
]


def test_phases_are_cut_at_the_runs_own_lines():
    ph = smoke.phases(LINES, end_s=116.0)
    assert ph == {
        "cli_prefect_server": 14.6,
        "cells_gateway": 8.9,
        "to_first_decision": 22.7,
        "loop": 41.3,
        "report_summary_teardown": 20.6,
        "exit": 7.9,
    }
    assert smoke.fixed_share(ph) == pytest.approx(1 - 41.3 / 116.0)
    assert "**" in smoke.table([ph, ph])


def test_a_missing_boundary_is_named():
    with pytest.raises(ValueError, match="cells_gateway"):
        smoke.phases([line for line in LINES if "gateway up" not in line[1]], end_s=116.0)
