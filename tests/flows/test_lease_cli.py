"""One writer per run, from the command line: while a `gyre serve` holds a run id, a second
`gyre serve` or a `gyre run` of the same store and run id is refused (rc 2, the holder
named) and the first one's log is left alone; run ids that are not one path component are
refused before anything is written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.flows.test_serve_cli import _chat, _session, _tito_rows, _wait_up

pytestmark = pytest.mark.integration

GYRE = [sys.executable, "-m", "flows.cli"]


@pytest.fixture()
def env(tmp_path):
    return {**os.environ, "GYRE_CACHE": str(tmp_path / "cache")}


def test_second_serve_and_run_of_a_live_run_id_are_refused(tmp_path, free_port, env):
    store = str(tmp_path / "store")
    port, port2 = free_port(), free_port()
    record = tmp_path / "cache" / "serve" / f"{port}.json"
    first = subprocess.Popen(
        [*GYRE, "serve", "--store", store, "--port", str(port), "--run-id", "shared"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _wait_up(first, record)
        sess = json.loads(_session(env, "--port", str(port)).stdout)
        call = _chat(sess).id
        second = subprocess.run(
            [*GYRE, "serve", "--store", store, "--port", str(port2), "--run-id", "shared"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert f"gyre serve (port {port})" in second.stderr
        assert f"pid {first.pid} on" in second.stderr and "since" in second.stderr
        assert "Traceback" not in second.stderr
        run = subprocess.run(
            [*GYRE, "run", "--store", store, "--preset", "tiny", "run_id=shared"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 2, run.stderr
        assert f"pid {first.pid} on" in run.stderr and "Traceback" not in run.stderr
        assert _chat(sess, "still mine").id  # the first server goes on, its key valid
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    assert first.returncode == 0
    # the first server's answered calls reach the store once (no one replayed its live log)
    rows = _tito_rows(store)
    assert len(rows) == 2 and call in {r["request_id"] for r in rows}
    # released at exit: the run id is free again for the next process
    again = subprocess.Popen(
        [*GYRE, "serve", "--store", store, "--port", str(port2), "--run-id", "shared"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _wait_up(again, tmp_path / "cache" / "serve" / f"{port2}.json")
    finally:
        again.send_signal(signal.SIGTERM)
        again.communicate(timeout=60)


def test_run_ids_that_leave_the_cache_are_refused(tmp_path, free_port, env):
    store = str(tmp_path / "store")
    serve = subprocess.run(
        [*GYRE, "serve", "--store", store, "--port", str(free_port()), "--run-id", "../../../x"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert serve.returncode == 2 and "--run-id" in serve.stderr and "bad run id" in serve.stderr
    assert "Traceback" not in serve.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "cache" / "spool").exists()
    resume = subprocess.run(
        [*GYRE, "run", "--store", store, "--resume", "../victim"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert resume.returncode == 2 and "bad run id" in resume.stderr


def test_the_paths_refuse_bad_run_ids_as_a_last_guard():
    from storage.paths import RunIdError, check_run_id, spool_dir

    for bad in ("../x", "..", "a/../../b", "/abs", ".x", "", "a" * 101, "a..b", "a\nb", "ab\n"):
        with pytest.raises(RunIdError):
            spool_dir("./store", bad)
    for good in ("serve", "run-20261201-161600-abc123", "a.b_c-1", "a" * 100):
        assert check_run_id(good) == good


def test_the_flow_itself_refuses_a_held_run(prefect_harness, tmp_path):
    """A deployment run (no CLI in front) is refused too, before it writes anything."""
    from flows.rl_run import rl_run
    from storage.lease import Lease, LeaseHeld
    from storage.store import Store

    st = Store(str(tmp_path / "store"))
    with Lease(st, "held", "gyre serve (port 1)"), pytest.raises(LeaseHeld, match="port 1"):
        rl_run(preset="tiny", store=st.url, run_id="held", resume=True)
    assert not st.exists("checkpoints") and not st.exists("runs")
