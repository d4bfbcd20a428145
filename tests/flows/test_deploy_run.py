"""The deployments of prefect.yaml, run for real: ``prefect deploy --all`` against a Prefect
API, a ``prefect worker`` process on a process work pool, and runs triggered the way the
UI's Run button triggers them (``POST /api/deployments/{id}/create_flow_run``).

The nightly deployment is triggered twice, as two nights would: the second run continues
the first one's run (its step numbers and weight versions go on, on new tasks). Each run
completes with its artifacts (summary, settings, progress "step k of N, reward r") and a
name that says what it is. A schedule a user made survives ``prefect deploy --all``.
"""

from __future__ import annotations

import contextlib
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

pytestmark = [pytest.mark.deploy, pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PREFECT = [sys.executable, "-m", "prefect"]
RUN = "nightly-test"


def _env(api: str) -> dict[str, str]:
    return {
        **os.environ,
        "PREFECT_API_URL": api,
        "GYRE_HOME": str(ROOT),  # the pull step's working directory
        "PYTHONPATH": str(ROOT),  # this checkout, not an installed gyre
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_CLI_PROMPT": "false",
    }


def _deploy(api: str) -> None:
    out = subprocess.run(
        [*PREFECT, "--no-prompt", "deploy", "--all"],
        cwd=ROOT,
        env=_env(api),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def _trigger(api: str, deployment_id: str, parameters: dict) -> str:
    """What the UI's Run button does: create a flow run of the deployment.

    A 503 is Prefect's word for "retry" (its SQLite was locked by another writer: CI's slow pass
    shares one harness database across tests); the UI retries, as Prefect's own client does
    (PREFECT_CLIENT_MAX_RETRIES), so this does too, a few times with backoff. The insert is
    rolled back on a 503, so a retry never makes a second flow run.
    """
    for attempt in range(6):
        r = httpx.post(
            f"{api}/deployments/{deployment_id}/create_flow_run",
            json={
                "parameters": parameters,
                "state": {"type": "SCHEDULED", "message": "Run button"},
            },
            timeout=30,
        )
        if r.status_code != 503 or attempt == 5:
            break
        time.sleep(2**attempt)
    r.raise_for_status()
    return r.json()["id"]


def _wait_done(api: str, flow_run_id: str, worker: subprocess.Popen, log: Path) -> dict:
    deadline = time.monotonic() + 600
    while True:
        r = httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=30)
        if r.status_code == 503:  # Prefect's "retry" (its database busy): poll again
            assert time.monotonic() < deadline, f"503 after 600s: {log.read_text()[-5000:]}"
            time.sleep(1)
            continue
        r.raise_for_status()
        run = r.json()
        state = (run.get("state") or {}).get("type")
        if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            assert state == "COMPLETED", f"{state}: {log.read_text()[-5000:]}"
            return run
        assert worker.poll() is None, f"the worker exited: {log.read_text()[-5000:]}"
        assert time.monotonic() < deadline, f"still {state} after 600s: {log.read_text()[-5000:]}"
        time.sleep(1)


def test_nightly_deployment_continues_one_run(prefect_harness, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        api = str(client.api_url).rstrip("/")
        with contextlib.suppress(ObjectAlreadyExists):  # another test made it
            client.create_work_pool(WorkPoolCreate(name="gyre", type="process"))
    t0 = time.monotonic()
    _deploy(api)
    log = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [*PREFECT, "worker", "start", "--pool", "gyre", "--type", "process"],
        cwd=tmp_path,
        env=_env(api),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    store = tmp_path / "store"
    params = {
        "preset": "tiny",
        "store": str(store),
        "run_id": RUN,
        "resume": True,
        "more_steps": 1,
        "overrides": ["rollout.group_size=2"],
    }
    try:
        with get_client(sync_client=True) as client:
            dep = client.read_deployment_by_name("rl_run/gyre-nightly")
            assert dep.global_concurrency_limit.limit == 1
            assert dep.parameter_openapi_schema["properties"]["preset"]["anyOf"][0]["enum"]
        runs = []
        for _night in range(2):
            fid = _trigger(api, str(dep.id), params)
            runs.append(_wait_done(api, fid, worker, log))
        wall = time.monotonic() - t0
        # a schedule the user made (and turned on) survives the next `prefect deploy --all`
        with get_client(sync_client=True) as client:
            client.create_deployment_schedules(
                dep.id, [(CronSchedule(cron="0 2 * * *", timezone="UTC"), True)]
            )
        _deploy(api)
        with get_client(sync_client=True) as client:
            schedules = client.read_deployment_schedules(dep.id)
            artifacts = client.read_artifacts()
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
    assert [(s.schedule.cron, s.active) for s in schedules] == [("0 2 * * *", True)]
    # names say what each run is: the run id, how it started, which steps
    assert runs[0]["name"] == f"{RUN} | resume | steps 0-0 of 1", runs[0]["name"]
    assert runs[1]["name"] == f"{RUN} | resume | steps 1-1 of 2", runs[1]["name"]
    # the second night continued the first one's run: steps, versions, new tasks
    st = Store(str(store))
    steps = query(st, f"SELECT step, weight_version FROM steps WHERE run_id = '{RUN}' ORDER BY 1")
    assert [(r["step"], r["weight_version"]) for r in steps.to_pylist()] == [(0, 1), (1, 2)]
    groups = query(st, "SELECT group_id, min(step) AS s FROM rollouts GROUP BY 1").to_pylist()
    assert len({g["group_id"] for g in groups}) == len(groups) >= 2
    # artifacts: the summary (rounded figures, the run's own query), settings, progress
    by_key: dict[str, list] = {}
    for a in artifacts:
        by_key.setdefault(a.key, []).append(a)
    summary = max(by_key[f"gyre-summary-{RUN}"], key=lambda a: a.created)
    assert f"WHERE run_id = '{RUN}'" in summary.data
    assert "mean_reward" in summary.data
    for line in summary.data.splitlines():  # no float printed with more than 4 significant digits
        if line.startswith("| mean_reward"):
            assert len(line.split("|")[2].strip().replace("0.", "").lstrip("0")) <= 5, line
    assert "```yaml" in max(by_key[f"gyre-config-{RUN}"], key=lambda a: a.created).data
    progress = max(by_key[f"gyre-progress-{RUN}"], key=lambda a: a.created)
    assert progress.type == "progress" and float(progress.data) == 100.0
    assert progress.description.startswith(f"{RUN}: step 2 of 2, reward ")
    print(f"\ndeploy + two nightly runs + redeploy: {wall:.0f}s")
