"""``cluster.scheduler_address``: a run on a ``dask scheduler`` and ``dask worker`` processes
started here, as on a cluster (the README's scale-out recipe): the workers become the
cells, the run trains every step, its log links the scheduler's dashboard (which answers),
and the workers are still there, with their engines stopped, when the run is over.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from storage.sql import query
from storage.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]


def _cli(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "dask"), *args]


def test_run_on_an_external_dask_cluster(prefect_harness, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter

    from flows.rl_run import rl_run

    with get_client(sync_client=True) as client:
        api = str(client.api_url).rstrip("/")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_API_URL": api, "OMP_NUM_THREADS": "1"}
    sfile = tmp_path / "scheduler.json"

    def start(args: list[str], log: str) -> subprocess.Popen:
        return subprocess.Popen(
            _cli(*args),
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / log).open("w"),
        )

    scheduler = ["scheduler", "--host", "127.0.0.1", "--port", "0"]
    scheduler += ["--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(sfile)]
    procs = [start(scheduler, "scheduler.log")]
    try:
        deadline = time.monotonic() + 60
        while not sfile.exists():
            assert time.monotonic() < deadline, (tmp_path / "scheduler.log").read_text()
            time.sleep(0.2)
        time.sleep(0.5)
        address = json.loads(sfile.read_text())["address"]
        for i in range(2):
            worker = ["worker", "--scheduler-file", str(sfile), "--nthreads", "6"]
            worker += ["--memory-limit", "0", "--host", "127.0.0.1", "--name", f"cell{i}"]
            procs.append(start(worker, f"worker{i}.log"))
        summary = rl_run(
            preset="tiny",
            store=str(tmp_path / "store"),
            overrides=[f"cluster.scheduler_address={address}", "rollout.group_size=2"],
        )
        assert summary["steps"] == 2 and summary["weight_version"] == 2
        store = Store(str(tmp_path / "store"))
        cells = query(store, "SELECT DISTINCT cell_id FROM cells WHERE event = 'join'")
        assert cells.num_rows == 2
        with get_client(sync_client=True) as client:
            logs = client.read_logs(LogFilter(), limit=200, offset=0)
            offset = 200
            while page := client.read_logs(LogFilter(), limit=200, offset=offset):
                logs += page
                offset += 200
        links = [x.message.split(": ", 1)[1] for x in logs if "Dask dashboard:" in x.message]
        assert links, "no dashboard link in the run's log"
        assert httpx.get(links[-1], timeout=30, follow_redirects=True).status_code == 200
        assert all(p.poll() is None for p in procs)  # the cluster outlives the run
    finally:
        for p in reversed(procs):
            os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
