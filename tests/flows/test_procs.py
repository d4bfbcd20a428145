"""What a killed run leaves behind is stopped by the next start (flows/procs.py).

A real "run" process records the processes it started (one in a session of its own, as
the temporary Prefect server is), then is SIGKILLed: its child survives it, and
``reap_orphans`` (what every ``gyre run`` calls first) stops that child, and only it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

OWNER = """
import subprocess, sys, time
from flows.procs import record_children
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                         start_new_session=True)
record_children()
print(child.pid, flush=True)
time.sleep(300)
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_orphans_of_a_killed_run_are_reaped_by_the_next_start(cache):
    from flows.procs import reap_orphans

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    child = psutil.Process(int(owner.stdout.readline()))
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        assert reap_orphans() == []  # the owner lives: its processes are left alone
        assert child.is_running()
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        time.sleep(0.2)
        assert child.is_running()  # an orphan now
        assert reap_orphans() == [child.pid]
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
        assert bystander.poll() is None  # nothing else was touched
        assert not list((cache / "procs").glob("*.json"))  # the record is gone too
        assert reap_orphans() == []
    finally:
        bystander.kill()
        if child.is_running():
            child.kill()


STOPPER = """
import contextlib, os, signal, time
from flows.procs import StopRequested, bounded_stop, check_stop, stop_points
for deferred in (True, False):
    try:
        with bounded_stop(bound_s=60), (stop_points() if deferred else contextlib.nullcontext()):
            try:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while a library call is under way
                time.sleep(0.5)
                print("call finished", flush=True)
            except BaseException as exc:
                print(f"landed in the call: {exc!r}", flush=True)
                raise RuntimeError("wrapped") from exc  # what pydantic's serializer does
            check_stop()
            print("no stop", flush=True)
    except StopRequested as exc:
        print(f"stopped {exc}", flush=True)
"""


def test_a_stop_is_raised_at_a_stop_point_and_ends_the_run_as_stopped():
    out = subprocess.run(
        [sys.executable, "-c", STOPPER], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "call finished",  # inside stop_points: deferred to check_stop()
        "stopped SIGINT",
        "landed in the call: StopRequested('SIGINT')",  # outside: raised where it lands,
        "stopped SIGINT",  # and what the library made of it still ends the run as stopped
    ], out.stdout + out.stderr


@pytest.mark.slow
def test_the_flow_is_imported_while_the_temporary_server_starts(monkeypatch, cache):
    """``prefect_api(while_starting=...)``: the import runs before the server answers (the
    two overlap), with ``PREFECT_API_URL`` already the server's, which then answers."""
    import httpx

    from flows.procs import prefect_api

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    seen = []

    def importing() -> None:
        url = os.environ.get("PREFECT_API_URL")
        try:
            up = httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            up = False
        seen.append((url, up))

    with prefect_api(while_starting=importing) as url:
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert seen == [(url, False)]
    assert "PREFECT_API_URL" not in os.environ
