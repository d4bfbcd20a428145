"""bench/smoke.py cuts a ``gyre run --preset tiny``'s stamped output into its phases at the
lines the run prints anyway (the real run end to end: ``python bench/smoke.py --quick``)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
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
    assert smoke.startup_share(ph) == pytest.approx((14.6 + 8.9 + 22.7) / 116.0)
    assert "**" in smoke.table([ph, ph])


def test_a_missing_boundary_is_named():
    with pytest.raises(ValueError, match="cells_gateway"):
        smoke.phases([line for line in LINES if "gateway up" not in line[1]], end_s=116.0)


def test_the_floor_runs_the_fixed_cpu_on_every_core():
    ph = {"cli_prefect_server": 5.0, "loop": 10.0, "exit": 1.0}
    cpu = {"cli_prefect_server": 26.0, "loop": 14.0, "exit": 4.0}
    # 30 fixed CPU seconds on 2 cores are 15 s at best, against a 10 s loop
    assert smoke.fixed_share_floor(ph, cpu, cores=2) == pytest.approx(15 / 25)
    assert smoke.fixed_share_floor(ph, cpu, cores=30) == pytest.approx(1 / 11)


def test_tree_cpu_counts_the_processes_under_the_run():
    # a shell whose child burns CPU: the shell itself uses next to none
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass"
    proc = subprocess.Popen(
        ["sh", "-c", f'{sys.executable} -c "{busy}"; sleep 30'],
    )
    try:
        ps = psutil.Process(proc.pid)
        cpu = 0.0
        for _ in range(100):  # until the child has burnt its CPU and been reaped
            cpu = smoke.tree_cpu_s(ps)
            if [c.name() for c in ps.children()] == ["sleep"]:  # the child was reaped
                break
            time.sleep(0.1)
        assert cpu >= 0.5
    finally:
        proc.kill()
        proc.wait()


def test_the_loop_is_what_the_flow_times_and_its_report_is_shut_down():
    """The schedule flow writes its report before it prints its line: those seconds are
    fixed work, not the loop's."""
    lines = [(t, s.replace("2 steps in 41.3s", "2 steps in 39.8s")) for t, s in LINES]
    ph = smoke.loop_as_timed(smoke.phases(lines, end_s=116.0), lines)
    assert ph["loop"] == 39.8
    assert ph["report_summary_teardown"] == pytest.approx(20.6 + 1.5)
    assert sum(ph.values()) == pytest.approx(116.0)
    # a printed time longer than the phase (clocks apart) changes nothing
    longer = [(t, s.replace("2 steps in 41.3s", "2 steps in 45.0s")) for t, s in LINES]
    assert smoke.loop_as_timed(smoke.phases(longer, 116.0), longer)["loop"] == 41.3
