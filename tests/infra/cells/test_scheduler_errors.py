"""An external Dask scheduler (``cluster.scheduler_address``) that cannot hold the run, or
that is lost mid-run, gives an error naming the scheduler, what is wrong and the fix,
never Dask's bare TimeoutError after 300 s or ``CommClosedError``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.cells.cluster import SchedulerLost, TooFewWorkers, start_cells, wait_for_cells

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
DASK = str(Path(sys.executable).parent / "dask")
GYRE = [sys.executable, "-m", "flows.cli"]


class DaskProcs:
    """A ``dask scheduler`` and ``dask worker`` processes, as on a cluster."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.sfile = tmp_path / "scheduler.json"
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                    "GYRE_CACHE": str(tmp_path / "cache")}  # fmt: skip
        self.procs: list[subprocess.Popen] = []
        self.scheduler = self._start(
            ["scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address",
             "127.0.0.1:0", "--scheduler-file", str(self.sfile)], "scheduler.log",
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while not self.sfile.exists():
            assert time.monotonic() < deadline, (tmp_path / "scheduler.log").read_text()
            time.sleep(0.2)
        time.sleep(0.5)
        self.address = json.loads(self.sfile.read_text())["address"]

    def _start(self, args: list[str], log: str) -> subprocess.Popen:
        p = subprocess.Popen(
            [DASK, *args],
            env=self.env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=(self.tmp / log).open("w"),
        )
        self.procs.append(p)
        return p

    def add_workers(self, n: int) -> None:
        from distributed import Client

        for _ in range(n):
            i = len(self.procs)
            self._start(
                ["worker", "--scheduler-file", str(self.sfile), "--nthreads", "6",
                 "--memory-limit", "0", "--host", "127.0.0.1", "--name", f"cell{i}"],
                f"worker{i}.log",
            )  # fmt: skip
        with Client(self.address, timeout="30s", set_as_default=False) as client:
            client.wait_for_workers(len(self.procs) - 1, timeout=120)

    def kill_scheduler(self) -> None:
        os.killpg(self.scheduler.pid, signal.SIGKILL)
        self.scheduler.wait()

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


@pytest.fixture()
def dask_procs(tmp_path):
    procs = DaskProcs(tmp_path)
    yield procs
    procs.stop()


def test_too_few_workers_names_have_need_and_fix(dask_procs):
    from distributed import Client

    dask_procs.add_workers(1)
    with Client(dask_procs.address, timeout="30s", set_as_default=False) as client:
        t0 = time.monotonic()
        with pytest.raises(TooFewWorkers) as ei:
            wait_for_cells(client, 2, timeout=1.0)
        assert time.monotonic() - t0 < 10
    msg = str(ei.value)
    assert f"the Dask scheduler at {dask_procs.address} has 1 worker(s)" in msg
    assert "this run needs 2" in msg and f"dask worker {dask_procs.address}" in msg
    assert "cluster.rollout_cells" in msg


def test_a_lost_scheduler_is_named(dask_procs):
    dask_procs.add_workers(1)
    t0 = time.monotonic()
    with (
        pytest.raises(SchedulerLost) as ei,
        start_cells(1, scheduler_address=dask_procs.address) as cells,
    ):
        assert len(cells.alive()) == 1
        dask_procs.kill_scheduler()
        raise OSError("what the run's next call to the scheduler raises")
    msg = str(ei.value)
    assert f"the Dask scheduler at {dask_procs.address} is gone" in msg
    assert "start `dask scheduler` there again" in msg
    assert time.monotonic() - t0 < 30  # no teardown through the lost scheduler (60 s)


@pytest.mark.slow
def test_gyre_run_refuses_a_scheduler_with_too_few_workers_quickly(dask_procs, tmp_path):
    dask_procs.add_workers(1)
    t0 = time.monotonic()
    res = subprocess.run(
        [*GYRE, "run", "--store", str(tmp_path / "store"),
         f"cluster.scheduler_address={dask_procs.address}"],
        capture_output=True, text=True, timeout=300, env=dask_procs.env,
    )  # fmt: skip
    assert time.monotonic() - t0 < 90  # it waited 300 s for workers, then a TimeoutError
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert f"cluster.scheduler_address='{dask_procs.address}'" in res.stderr
    assert "has 1 worker(s)" in res.stderr and "this run needs 2" in res.stderr
    assert f"dask worker {dask_procs.address}" in res.stderr


@pytest.mark.slow
def test_gyre_run_names_a_scheduler_lost_mid_run(dask_procs, tmp_path):
    dask_procs.add_workers(2)
    store = tmp_path / "store"
    proc = subprocess.Popen(
        [*GYRE, "run", "--store", str(store), "train.steps=50", "rollout.group_size=2",
         "run_id=lost", f"cluster.scheduler_address={dask_procs.address}"],
        env=dask_procs.env, stdout=subprocess.DEVNULL, stderr=(tmp_path / "run.log").open("w"),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while "cells and gateway up" not in (tmp_path / "run.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        time.sleep(5)  # the run is rolling out
        dask_procs.kill_scheduler()
        t0 = time.monotonic()
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = (tmp_path / "run.log").read_text()
    assert time.monotonic() - t0 < 150, err[-3000:]
    assert rc == 1, err[-3000:]
    last = err.strip().splitlines()[-1]  # what the user reads last: no traceback
    assert last.startswith(f"gyre run: the Dask scheduler at {dask_procs.address} is gone"), last
    assert f"gyre run --resume lost --store {store}" in last
