"""Prefect's "Finished in state Completed()" per task run is dropped (about half of a run's
log lines); a failed task still says how it ended."""

from __future__ import annotations

import pytest

from infra.cells.cluster import quiet_completed_tasks

pytestmark = pytest.mark.integration


def test_completed_tasks_log_no_finished_line_failed_ones_do(prefect_harness):
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging import get_run_logger
    from prefect.runtime import flow_run

    @task
    def ok(i: int) -> int:
        get_run_logger().info("task %d says something useful", i)
        return i

    @task(retries=0)
    def boom() -> None:
        raise ValueError("broken")

    @flow
    def noisy() -> str:
        for i in range(3):
            ok(i)
        boom(return_state=True)
        return flow_run.id

    quiet_completed_tasks()
    quiet_completed_tasks()  # idempotent
    run_id = noisy()
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
    task_lines = [x.message for x in logs if x.task_run_id is not None]
    assert sum("says something useful" in m for m in task_lines) == 3
    assert not [m for m in task_lines if m == "Finished in state Completed()"]
    assert any(m.startswith("Finished in state Failed") for m in task_lines), task_lines
