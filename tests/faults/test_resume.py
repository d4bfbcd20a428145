"""``gyre run`` SIGKILLed mid-run, then ``gyre run --resume RUN_ID``; and Ctrl-C.

Killed: the ``gyre run`` process itself (SIGKILL: no cleanup code runs), after its first
step committed, while rollouts are answering calls. Then the next start resumes it.

What must hold: the killed run's temporary Prefect server and cells do not outlive it (they
end with it, or the next start stops them); the answered calls it had only in its local
write-ahead log reach the store once; the resumed run continues the step numbers and
weight versions from the last committed step (steps 0..N-1 and versions 1..N once each),
trains no sample twice and repeats no call (unique TITO request ids), on new tasks.

Ctrl-C (SIGINT to the run's process group, as a terminal sends it) ends the run within a
bound, with exit status 130, no traceback, nothing left running, every answered call in
the store.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from storage.checkpoints import latest_version
from storage.paths import cache_dir, spool_dir
from storage.sql import query
from storage.store import Store
from storage.tito_log import read_wal

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GYRE = [sys.executable, "-m", "flows.cli"]
SETTINGS = [
    "rollout.subtasks=3",
    "scheduler.pacing.env_step_s=0.2",
    "scheduler.pacing.train_s_per_token=0.001",
]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)  # the run starts its own temporary server
    return env


def _start(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        GYRE + args,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=_env(),
        cwd=ROOT,
        start_new_session=True,  # its own process group, as a shell job would be
    )


def _wait_for(what: str, cond, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"the run ended ({proc.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{what} within {timeout}s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def _recorded(pid: int) -> list[psutil.Process]:
    """The processes a run recorded (its Prefect server and cells), while alive."""
    rec = json.loads((cache_dir() / "procs" / f"{pid}.json").read_text())
    out = []
    for c in rec["children"]:
        try:
            p = psutil.Process(c["pid"])
            if abs(p.create_time() - c["created"]) < 1e-3 and p.status() != "zombie":
                out.append(p)
        except psutil.Error:
            pass
    return out


def _rows(store: Store, sql: str) -> list[dict]:
    return query(store, sql).to_pylist()


def test_sigkilled_run_resumes_without_duplicates(tmp_path):
    store_dir, run = tmp_path / "store", "killed-run"
    store = Store(str(store_dir))
    log = tmp_path / "first.log"
    t0 = time.monotonic()
    first = _start(
        ["run", "--preset", "tiny", "--store", str(store_dir), f"run_id={run}", "train.steps=6"]
        + SETTINGS,
        log,
    )
    rec = cache_dir() / "procs" / f"{first.pid}.json"
    _wait_for("a step committed", lambda: (latest_version(store, run) or 0) >= 1, first, log)
    _wait_for("the cells recorded", lambda: rec.exists() and len(_recorded(first.pid)) >= 3, first, log)  # fmt: skip
    before = len(_rows(store, f"SELECT * FROM tito WHERE run_id = '{run}'"))
    _wait_for(
        "more calls answered",
        lambda: (
            len(_rows(store, f"SELECT * FROM tito WHERE run_id = '{run}'")) > before
            or any(
                read_wal(w) for w in glob.glob(str(spool_dir(store.url, run) / "tito" / "*.log"))
            )
        ),
        first,
        log,
    )
    orphans = _recorded(first.pid)
    # the cells are forks of the run's zygote (infra/cells/zygote.py), not fresh interpreters
    names = sorted(p.name() for p in orphans)
    assert names.count("gyre-zygote") == 1 and names.count("gyre-cell") >= 2, names
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    # its Prefect server (own session, tied to the run's process) and cells end by themselves
    _, alive = psutil.wait_procs(orphans, timeout=30)
    assert not [p for p in alive if p.status() != "zombie"], [p.cmdline()[:4] for p in alive]
    # what the killed run answered: in the store, or only in its write-ahead log
    stored = {r["request_id"] for r in _rows(store, "SELECT request_id FROM tito")}
    wal = {
        r.request_id
        for w in glob.glob(str(spool_dir(store.url, run) / "tito" / "*.log"))
        for r in read_wal(w)
    }
    steps_before = _rows(store, f"SELECT step FROM steps WHERE run_id = '{run}'")
    assert 1 <= len(steps_before) < 6
    # resume
    log2 = tmp_path / "resume.log"
    second = _start(["run", "--resume", run, "--store", str(store_dir)], log2)
    rc = second.wait(timeout=600)
    assert rc == 0, log2.read_text()[-4000:]
    wall = time.monotonic() - t0
    assert "resuming at step" in log2.read_text()
    assert "still alive after" not in log2.read_text()  # cells left without being killed
    steps = _rows(
        store, f"SELECT step, weight_version FROM steps WHERE run_id = '{run}' ORDER BY 1"
    )
    assert [(r["step"], r["weight_version"]) for r in steps] == [(k, k + 1) for k in range(6)]
    assert not _rows(store, "SELECT sample_id FROM ledger GROUP BY 1 HAVING count(*) > 1")
    tito = _rows(store, "SELECT request_id, session_id, seq_no FROM tito")
    ids = [r["request_id"] for r in tito]
    assert len(set(ids)) == len(ids)
    assert (stored | wal) <= set(ids), "answered calls of the killed run were lost"
    # new tasks: no group number of the first run was started again
    groups = _rows(store, "SELECT group_id, count(DISTINCT step) AS n FROM rollouts GROUP BY 1")
    assert all(g["n"] == 1 for g in groups)
    print(f"\nkilled after {len(steps_before)} step(s), {len(wal - stored)} calls only in the "
          f"WAL; resumed to 6 steps; wall {wall:.0f}s")  # fmt: skip


def test_ctrl_c_stops_the_run_cleanly_within_a_bound(tmp_path):
    store_dir, run = tmp_path / "store", "stopped-run"
    store = Store(str(store_dir))
    log = tmp_path / "run.log"
    proc = _start(
        ["run", "--preset", "tiny", "--store", str(store_dir), f"run_id={run}", "train.steps=20"]
        + SETTINGS,
        log,
    )
    _wait_for("a step committed", lambda: (latest_version(store, run) or 0) >= 1, proc, log)
    started = _recorded(proc.pid)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    rc = proc.wait(timeout=120)
    took = time.monotonic() - t0
    out = log.read_text()
    assert rc == 130, out[-4000:]
    assert took < 90, f"stopping took {took:.0f}s"
    assert "Traceback" not in out, out[-4000:]
    assert "gyre run --resume" in out
    _, alive = psutil.wait_procs(started, timeout=10)
    assert not [p for p in alive if p.status() != "zombie"]
    assert not (cache_dir() / "procs" / f"{proc.pid}.json").exists()
    # every answered call reached the store; the write-ahead log holds nothing more
    wal = [
        r for w in glob.glob(str(spool_dir(store.url, run) / "tito" / "*.log")) for r in read_wal(w)
    ]
    stored = {r["request_id"] for r in _rows(store, "SELECT request_id FROM tito")}
    assert {r.request_id for r in wal} <= stored
    assert "Restarting worker" not in out  # no cell died on its own
    assert "still alive after" not in out  # and none was killed at the end
    print(f"\nCtrl-C: stopped in {took:.1f}s")
