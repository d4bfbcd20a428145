"""The zygote's own lifetime and what it leaves in the run's process, without a Dask cluster
(issue 26: generated mutants of infra/cells/zygote.py that test_zygote.py let through).

One script, in a process of its own (a zygote is forked from a single-threaded process,
which pytest's is not), checks:

- a zygote whose fork server fails exits with status 1 and never returns into the run's
  code (``code = None`` or ``os._exit(None)`` made the forked copy raise out of
  `start_zygote` and run the caller's ``except``: a second copy of the run);
- a zygote whose "alive" pipe closes (every holder gone) exits with status 0;
- `start_zygote` works with a closed ``sys.stdout`` (a daemonised run: its flush raises);
- Dask's forkserver context imports nothing more into the run's process (pandas, lz4) once
  the zygote is its fork server;
- a dead zygote's pid is forgotten, so a later process given the same pid is never taken
  for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from multiprocessing import forkserver

    from infra.cells import zygote
    from infra.cells.zygote import start_zygote, zygote_pid

    out = {"me": os.getpid()}


    def boom(*args):
        raise RuntimeError("the fork server failed")


    if __name__ == "__main__":
        # 1. a fork server that fails: the zygote exits 1 and does not come back here
        real_main, forkserver.main = forkserver.main, boom
        try:
            zpid = start_zygote(())
        except BaseException as exc:
            print("ESCAPED " + json.dumps({"pid": os.getpid(), "exc": repr(exc)}), flush=True)
            os._exit(3)
        forkserver.main = real_main
        out["failed_status"] = os.waitstatus_to_exitcode(os.waitpid(zpid, 0)[1])
        out["failed_forgotten"] = zygote_pid() is None and zygote._zygote["pid"] is None

        # 2. a zygote started with a closed stdout
        real_stdout, closed = sys.stdout, open(os.devnull, "w")
        closed.close()  # its flush raises ValueError (a closed StringIO's does not)
        sys.stdout = closed
        try:
            zpid = start_zygote(())
        finally:
            sys.stdout = real_stdout
        out["started"] = zpid is not None and zpid != out["failed_status"]
        out["pandas_before"] = "pandas" in sys.modules or "lz4" in sys.modules
        import distributed.utils
        distributed.utils.get_mp_context()
        out["pandas_after"] = "pandas" in sys.modules or "lz4" in sys.modules

        # 3. every holder of "alive" gone: the zygote ends with status 0
        os.close(forkserver._forkserver._forkserver_alive_fd)
        forkserver._forkserver._forkserver_alive_fd = None
        out["ended_status"] = os.waitstatus_to_exitcode(os.waitpid(zpid, 0)[1])
        out["ended_forgotten"] = zygote_pid() is None and zygote._zygote["pid"] is None
        print("RESULT " + json.dumps(out), flush=True)
    """
)


def test_the_zygote_ends_as_it_should_and_leaves_the_run_alone(tmp_path):
    script = tmp_path / "zygote_life.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    escaped = [ln for ln in proc.stdout.splitlines() if ln.startswith("ESCAPED ")]
    assert not escaped, f"a forked zygote returned into the run's code: {escaped}"
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(line[-1][len("RESULT ") :])
    assert out["failed_status"] == 1, out
    assert out["failed_forgotten"], out
    assert out["started"], out
    assert not out["pandas_before"], "precondition: the script has not imported pandas or lz4"
    assert not out["pandas_after"], "Dask's forkserver context preloaded into the run's process"
    assert out["ended_status"] == 0, out
    assert out["ended_forgotten"], out


SCRIPT2 = textwrap.dedent(
    """
    import io, json, logging, os, sys, time
    from multiprocessing import forkserver

    from infra.cells import zygote
    from infra.cells.zygote import start_zygote, zygote_pid

    out = {}
    logs = io.StringIO()
    handler = logging.StreamHandler(logs)
    zygote.log.addHandler(handler)


    def fds():
        return sorted(os.listdir("/proc/self/fd"))


    if __name__ == "__main__":
        # 1. a Python whose fork server lacks one of the fields set here: no zygote
        real_server = forkserver._forkserver
        class Partial:
            _forkserver_address = _forkserver_alive_fd = _lock = None  # no _forkserver_pid
        forkserver._forkserver = Partial()
        out["partial"] = start_zygote(())
        forkserver._forkserver = real_server

        # 2. the fork fails (out of processes): no zygote, a warning, nothing left open
        real_fork = os.fork
        def no_fork():
            raise OSError(11, "Resource temporarily unavailable")
        os.fork = no_fork
        start_zygote(())  # starts multiprocessing's resource tracker (its pipe stays open)
        logs.truncate(0)
        logs.seek(0)
        before = fds()
        out["no_fork"] = start_zygote(())
        out["fds_kept"] = fds() == before
        os.fork = real_fork
        out["warned"] = logs.getvalue().splitlines()

        # 3. a fork server that fails in a zygote whose stderr is closed (a daemonised run):
        #    it still exits 1 and never comes back here
        def boom(*args):
            raise RuntimeError("the fork server failed")
        real_main, forkserver.main = forkserver.main, boom
        real_stderr, closed = sys.stderr, open(os.devnull, "w")
        closed.close()
        sys.stderr = closed
        try:
            zpid = start_zygote(())
        except BaseException as exc:
            sys.stderr = real_stderr
            print("ESCAPED " + json.dumps({"pid": os.getpid(), "exc": repr(exc)}), flush=True)
            os._exit(3)
        sys.stderr = real_stderr
        forkserver.main = real_main
        out["closed_stderr_status"] = os.waitstatus_to_exitcode(os.waitpid(zpid, 0)[1])

        # 4. a zygote that serves: known by its pid, named, and started once
        zpid = start_zygote(())
        out["pid_known"] = zygote_pid() == zpid and zpid is not None
        out["again"] = start_zygote(()) == zpid
        address = forkserver._forkserver._forkserver_address  # a path on Linux (3.11)
        out["socket_mode"] = oct(os.stat(address).st_mode & 0o777)  # only this user connects
        deadline, name = time.monotonic() + 20, ""
        while time.monotonic() < deadline:
            with open(f"/proc/{zpid}/comm") as fh:
                name = fh.read().strip()
            if name == "gyre-zygote":
                break
            time.sleep(0.05)
        out["name"] = name
        os.close(forkserver._forkserver._forkserver_alive_fd)
        forkserver._forkserver._forkserver_alive_fd = None
        deadline = time.monotonic() + 30  # bounded: a second zygote would keep this one
        while time.monotonic() < deadline and os.waitpid(zpid, os.WNOHANG) == (0, 0):
            time.sleep(0.05)
        print("RESULT " + json.dumps(out), flush=True)
        os._exit(0)  # any zygote left is ended by PR_SET_PDEATHSIG
    """
)


def test_the_zygote_is_started_once_named_and_given_up_cleanly(tmp_path):
    script = tmp_path / "zygote_start.py"
    script.write_text(SCRIPT2)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    escaped = [ln for ln in proc.stdout.splitlines() if ln.startswith("ESCAPED ")]
    assert not escaped, f"a forked zygote returned into the run's code: {escaped}"
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(line[-1][len("RESULT ") :])
    assert out["partial"] is None, out
    assert out["no_fork"] is None and out["fds_kept"], out
    assert out["warned"] == [
        "could not fork the cells' zygote ([Errno 11] Resource temporarily unavailable);"
        " cells start as new processes"
    ], out
    assert out["closed_stderr_status"] == 1, out
    assert out["pid_known"] and out["again"], out
    assert out["name"] == "gyre-zygote", out
    assert out["socket_mode"] == "0o600", out


def _comm() -> str:
    with open("/proc/self/comm") as fh:
        return fh.read().strip()


def test_a_forked_cell_is_named_and_reseeded():
    """What runs in each cell right after its fork (here in the test's own process, its
    name put back after): its name, and numpy's and torch's generators reseeded, so two
    cells forked from one zygote never draw the same numbers."""
    import numpy as np
    import torch

    from infra.cells import zygote

    name = _comm()
    try:
        np.random.seed(5)
        first = np.random.rand()
        torch.manual_seed(5)
        np.random.seed(5)
        zygote._as_cell()
        assert _comm() == "gyre-cell"
        assert np.random.rand() != first
        assert torch.initial_seed() != 5
        zygote._set_name("a-name-longer-than-fifteen")
        assert _comm() == "a-name-longer-t"  # the kernel keeps 15 bytes
    finally:
        zygote._set_name(name)
    assert _comm() == name
