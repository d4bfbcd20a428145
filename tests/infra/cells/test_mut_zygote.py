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
