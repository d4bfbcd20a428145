"""Cells forked from the zygote (infra/cells/zygote.py) behave as freshly started ones.

The zygote is forked from a process that runs a single thread, which pytest's is not: each
test runs a small script in a process of its own, as `gyre run` starts it."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from infra.cells.zygote import start_zygote

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
RETITLED = importlib.util.find_spec("setproctitle") is not None  # Dask titles its processes

SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time

    import torch

    from infra.cells.cluster import start_cells
    from infra.cells.zygote import start_zygote, zygote_pid

    # the parent's own thread count and seed: what a cell inherits if nothing resets them
    torch.set_num_threads(3)
    torch.manual_seed(1234)
    PARENT = os.getpid()


    def probe(dask_worker=None):
        import threading

        import numpy as np
        import psutil

        out = {}

        def in_a_task_thread():  # tasks run in worker threads: torch's count there
            out["threads"] = torch.get_num_threads()

        t = threading.Thread(target=in_a_task_thread)
        t.start()
        t.join()
        me = psutil.Process()
        return {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "name": me.name(),
            "threads": out["threads"],
            "torch_seed": torch.initial_seed(),
            "np_draw": int(np.random.randint(1 << 30)),
            "preloaded": "infra.engine.engine" in sys.modules,
            "env": os.environ.get("GYRE_PROBE"),
            "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
        }


    if __name__ == "__main__":
        zpid = start_zygote(preload=("infra.engine.engine",))
        assert zpid is not None, "no zygote"
        out = {"parent": PARENT, "zygote": zpid}
        with start_cells(2, threads_per_cell=1, rollout_slots=1, harness_slots=1,
                         env={"GYRE_PROBE": "cell-env"}) as cells:
            first = cells.client.run(probe)
            out["cells"] = list(first.values())
            victim = sorted(first)[0]
            os.kill(first[victim]["pid"], signal.SIGKILL)  # its nanny starts it again
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    now = cells.client.run(probe)
                except OSError:  # the killed worker, still listed
                    now = {}
                if len(now) == 2 and first[victim]["pid"] not in [v["pid"] for v in now.values()]:
                    break
                time.sleep(0.2)
            out["after_kill"] = list(now.values())
            out["zygote_alive_after_cells"] = zygote_pid() is not None
            # the zygote itself dies: a killed cell's restart goes through a fresh fork server
            os.kill(zpid, signal.SIGKILL)
            # its cells die with it and both restart through a fresh fork server, which
            # imports torch again: a window of its own (under load that alone took minutes)
            deadline = time.monotonic() + 60
            while zygote_pid() is not None and time.monotonic() < deadline:
                time.sleep(0.1)
            victim2 = sorted(now)[0]
            os.kill(now[victim2]["pid"], signal.SIGKILL)
            again = {}
            while time.monotonic() < deadline + 240:
                try:
                    again = cells.client.run(probe)
                except OSError:
                    again = {}
                if len(again) == 2 and now[victim2]["pid"] not in [v["pid"] for v in again.values()]:
                    break
                time.sleep(0.2)
            out["after_zygote_died"] = list(again.values())
        print("RESULT " + json.dumps(out), flush=True)
    """
)


def _run_script(tmp_path: Path) -> dict:
    script = tmp_path / "zygote_probe.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(line[-1][len("RESULT ") :])


def test_cells_are_forks_of_the_zygote_with_their_own_state(tmp_path):
    out = _run_script(tmp_path)
    cells, zygote = out["cells"], out["zygote"]
    assert len(cells) == 2
    for c in cells:
        assert c["ppid"] == zygote, c  # forked from the zygote, not spawned by the nanny
        # named by the fork (`_as_cell`); where setproctitle is installed, Dask retitles its
        # workers ("dask worker [...]"; `make mutation` brings it), racing that name
        assert c["name"] == "gyre-cell" or (RETITLED and c["name"].startswith("dask worker")), c
        assert c["preloaded"], "the zygote's preload is not in the cell"
        assert c["env"] == "cell-env"  # the nanny's environment, applied after the fork
        assert c["threads"] == 1, c  # OMP_NUM_THREADS=1 of a cell, not the parent's 3
        assert c["sigint_ignored"]  # the cell plugin's own handler
    # each cell its own random state (a fork would copy the parent's)
    assert len({c["torch_seed"] for c in cells}) == 2
    assert 1234 not in {c["torch_seed"] for c in cells}
    assert len({c["np_draw"] for c in cells}) == 2
    # a killed cell's nanny starts it again from the zygote
    assert len(out["after_kill"]) == 2
    assert all(c["ppid"] == zygote and c["preloaded"] for c in out["after_kill"])
    assert out["zygote_alive_after_cells"]  # it serves until the run's process ends
    # with the zygote gone, a killed cell still comes back (from a fresh fork server)
    assert len(out["after_zygote_died"]) == 2, out["after_zygote_died"]
    assert zygote not in {c["ppid"] for c in out["after_zygote_died"]}
    # ... and then it ends
    deadline = time.monotonic() + 30
    while psutil.pid_exists(zygote) and time.monotonic() < deadline:
        try:
            if psutil.Process(zygote).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)
    alive = psutil.pid_exists(zygote) and psutil.Process(zygote).status() != "zombie"
    assert not alive, "the zygote outlived the run's process"


def test_no_zygote_while_another_thread_runs():
    """A fork copies only the calling thread: with a second one running (whatever lock it
    holds stays held in the copy), the cells are spawned as before."""
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, daemon=True)
    t.start()
    try:
        assert start_zygote() is None
    finally:
        stop.set()
        t.join()


DEAD_ZYGOTE = textwrap.dedent(
    """
    import os, signal, time

    import psutil
    from multiprocessing import forkserver

    from infra.cells.zygote import start_zygote, zygote_pid

    if __name__ == "__main__":
        zpid = start_zygote(())
        os.kill(zpid, signal.SIGKILL)
        while psutil.Process(zpid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.05)
        assert zygote_pid() is None
        # multiprocessing waits on its fork server's pid before starting a fresh one: the
        # zombie must still be there for it to reap
        forkserver.ensure_running()
        fresh = forkserver._forkserver._forkserver_pid
        assert fresh not in (None, zpid), fresh
        print("RESULT fresh", flush=True)
    """
)


def test_a_dead_zygote_gives_way_to_a_fresh_fork_server(tmp_path):
    """If the zygote dies (the OOM killer, a stray kill), the next cell (re)start goes
    through a fresh fork server; every cell's nanny also sees its cell as ended (its status
    pipe closed with the zygote) and starts it again, as a run heals lost cells."""
    script = tmp_path / "dead_zygote.py"
    script.write_text(DEAD_ZYGOTE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and "RESULT fresh" in proc.stdout, proc.stderr[-3000:]


ORPHAN = textwrap.dedent(
    """
    import json, multiprocessing, time

    from infra.cells.zygote import start_zygote

    if __name__ == "__main__":
        zpid = start_zygote(())
        # a process forked from the zygote, as a cell is: it holds the fork server's "alive"
        # pipe, so the zygote's end cannot come from the pipe alone
        cell = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(120,))
        cell.start()
        print("RESULT " + json.dumps({"zygote": zpid, "cell": cell.pid}), flush=True)
        time.sleep(120)
    """
)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_zygote_dies_with_a_sigkilled_run(tmp_path):
    """The run's process SIGKILLed (no handler, no cleanup runs): its zygote goes too, even
    while a cell forked from it lives on, instead of serving forks for nobody."""
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.Popen(
        [sys.executable, str(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    pids: dict[str, int] = {}
    try:
        line = run.stdout.readline()
        assert line.startswith("RESULT "), line
        pids = json.loads(line[len("RESULT ") :])
        assert not _gone(pids["zygote"]) and not _gone(pids["cell"])
        run.kill()
        run.wait(timeout=30)
        deadline = time.monotonic() + 30  # wide: a loaded host; it takes well under a second
        while not _gone(pids["zygote"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(pids["zygote"]), "the zygote outlived the SIGKILLed run"
        assert not _gone(pids["cell"])  # what held it; the zygote went on its own
    finally:
        run.kill()
        for pid in pids.values():
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
