"""Prefect submits off the scheduling loop (flows/submits.py): in priority then request
order, on a thread of their own, in the caller's context; on real Prefect and Dask, the task
runs stay the flow run's children and the Dask annotations reach the scheduler."""

from __future__ import annotations

import contextvars
import threading

import dask
import pytest

from flows.submits import PROCESS, ROLLOUT, STEP, Submits

VAR = contextvars.ContextVar("test_submits_var", default="unset")


def test_order_priority_then_request_and_off_the_callers_thread():
    subs = Submits()
    gate, holding = threading.Event(), threading.Event()
    seen: list[tuple[str, str]] = []

    def make(name: str) -> str:
        seen.append((name, threading.current_thread().name))
        return name

    try:
        first = subs.submit(ROLLOUT, lambda: holding.set() or (gate.wait(10) and make("first")))
        assert holding.wait(10)  # the thread holds the first submit: the rest queue
        jobs = [
            subs.submit(ROLLOUT, make, "r1"),
            subs.submit(ROLLOUT, make, "r2"),
            subs.submit(PROCESS, make, "p1"),
            subs.submit(STEP, make, "s1"),
            subs.submit(STEP, make, "s2"),
            subs.submit(ROLLOUT, make, "r3"),
        ]
        # every submit returned while the thread was still held by the first one
        assert not first._submitted.done() and not any(j._submitted.done() for j in jobs)
        gate.set()
        assert [j.future for j in jobs] == ["r1", "r2", "p1", "s1", "s2", "r3"]
    finally:
        subs.close()
    assert [n for n, _ in seen] == ["first", "s1", "s2", "p1", "r1", "r2", "r3"]
    assert {t for _, t in seen} == {"gyre-submit"}
    assert subs.stats.n == {"rollout": 4, "process": 1, "step": 2}


def test_the_flows_context_and_the_callers_dask_annotations_travel():
    """Submits run in the context of the thread that made ``Submits`` (the flow's), from
    any thread that asks, with the asking thread's Dask annotations."""
    token = VAR.set("flow-run")
    try:
        subs = Submits()
    finally:
        VAR.reset(token)
    out = {}

    def elsewhere():  # an executor thread: no flow context of its own
        with dask.annotate(resources={"harness": 1}):
            out["job"] = subs.submit(ROLLOUT, lambda: (VAR.get(), dask.get_annotations()))

    try:
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join(10)
        assert out["job"].future == ("flow-run", {"resources": {"harness": 1}})
        assert subs.submit(ROLLOUT, dask.get_annotations).future == {}
    finally:
        subs.close()


def test_a_failed_submit_is_a_done_job_that_raises():
    subs = Submits()
    called = threading.Event()

    def boom():
        raise RuntimeError("no task runner")

    try:
        job = subs.submit(PROCESS, boom)
        job.add_done_callback(called.set)
        assert called.wait(10)
        assert job.done() and job.key is None
        with pytest.raises(RuntimeError, match="no task runner"):
            job.result()
        job.cancel()  # nothing to cancel: no error
    finally:
        subs.close()


@pytest.mark.slow
def test_real_prefect_tasks_are_the_flows_children_and_placed(prefect_harness):
    """Tasks submitted through ``Submits`` from a flow on a DaskTaskRunner: each task run's
    parent is the flow run; ``workers`` annotations place them; the job verbs work on the
    Prefect futures, including a cancel asked before the submit was made."""
    from distributed import LocalCluster, get_worker
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.context import FlowRunContext
    from prefect_dask import DaskTaskRunner

    @task(name="where", task_run_name="where-{i}")
    def where(i: int) -> tuple[int, str]:
        return i, get_worker().address

    @task(name="slow-one")
    def slow_one(gate: str) -> str:
        from distributed import Event

        Event(gate).wait(30)
        return "late"

    with LocalCluster(
        n_workers=2, threads_per_worker=2, processes=False, dashboard_address=None
    ) as cl:
        addrs = sorted(cl.scheduler_info["workers"])

        @flow(task_runner=DaskTaskRunner(address=cl.scheduler_address))
        def f() -> tuple[str, list, bool, str | None]:
            subs = Submits()
            ended = threading.Event()
            try:
                jobs = []

                def ask(i: int) -> None:
                    with dask.annotate(workers=[addrs[i % 2]], allow_other_workers=False):
                        jobs.append(subs.submit(ROLLOUT, where.submit, i))

                for i in range(3):
                    ask(i)
                t = threading.Thread(target=ask, args=(3,))  # as the executor's threads do
                t.start()
                t.join(10)
                jobs[-1].add_done_callback(ended.set)
                out = [j.result(timeout=60) for j in jobs]
                assert ended.wait(10) and all(j.done() for j in jobs)
                key = jobs[0].key
                held = threading.Event()
                subs.submit(STEP, held.wait, 30)  # the thread is busy: the next submit waits
                late = subs.submit(PROCESS, slow_one.submit, "test-submits-gate")
                late.cancel()  # asked before its submit was made
                held.set()
                cancelled = _wait_for(late.done, 20) and late.future.wrapped_future.cancelled()
                return str(FlowRunContext.get().flow_run.id), out, cancelled, key
            finally:
                subs.close()

        run_id, out, cancelled, key = f()
    assert out == [(i, addrs[i % 2]) for i in range(4)]
    assert cancelled and key is not None

    import asyncio

    async def task_runs():
        async with get_client() as client:
            return await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
            )

    runs = asyncio.run(task_runs())
    names = sorted(r.name for r in runs if r.name.startswith("where-"))
    assert names == [f"where-{i}" for i in range(4)]
    assert all(str(r.flow_run_id) == run_id for r in runs)


def _wait_for(cond, timeout: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False
