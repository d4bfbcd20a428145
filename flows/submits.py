"""Prefect task submits off the scheduling loop.

A Prefect task submit on Dask costs the caller's thread a few hundredths of a second on a
quiet machine and 0.3-0.4 s on a loaded one (``PrefectDaskClient.submit`` serialises the
flow run's settings context and walks the parameters, all holding the GIL; measured with
cProfile on prefect 3.9). On the scheduling loop's thread, decisions and events waited
behind every one of them. ``Submits`` makes them on one thread of its own, in the context
of the flow run that created it (``contextvars.copy_context()`` on the flow's thread, as
Prefect's own sync helpers hand context to threads) with the Dask annotations of the thread
that asks (``dask.annotate``: resources, workers), so the task runs are the flow's children
in the UI as before, whichever executor thread asks for them, and hands back a
``PendingJob`` at once: the executor's ``Job`` verbs, pending until the submit has returned.

One thread keeps the submit order: units of work of one kind are submitted in the order they
were asked for (a cell's rollout groups in index order). Kinds have a priority
(``STEP`` < ``PROCESS`` < ``ROLLOUT``): a step's members do not queue behind the group starts
decided in the same tick (they wait for each other at the DP rendezvous), nor processing
behind rollouts (the buffer feeds the steps). ``Stats.loop_s`` measures what the loop still
spends per decision; ``Submits.stats`` what the submits cost and how long they queued.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import dask

log = logging.getLogger(__name__)

STEP, PROCESS, ROLLOUT = 0, 1, 2  # submit priorities: lower goes first
KIND = {STEP: "step", PROCESS: "process", ROLLOUT: "rollout"}


@dataclass
class SubmitStats:
    """Seconds the submit thread spent per kind (``submit_s``), seconds submits waited in
    its queue (``queued_s``), and their count (``n``)."""

    submit_s: dict[str, float] = field(default_factory=dict)
    queued_s: dict[str, float] = field(default_factory=dict)
    n: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, queued: float, took: float) -> None:
        self.submit_s[kind] = self.submit_s.get(kind, 0.0) + took
        self.queued_s[kind] = self.queued_s.get(kind, 0.0) + queued
        self.n[kind] = self.n.get(kind, 0) + 1

    def as_dict(self) -> dict[str, dict[str, float]]:
        r = lambda d: {k: round(v, 3) for k, v in d.items()}  # noqa: E731
        return {"submit_s": r(self.submit_s), "queued_s": r(self.queued_s), "n": dict(self.n)}


class PendingJob:
    """A Prefect future on Dask whose submit may not have returned yet, seen through the
    executor's ``Job`` verbs: not ``done`` before it is submitted; a submit that raised is
    done and its ``result`` raises; ``cancel`` before the submit cancels the task as soon
    as it exists."""

    def __init__(self, submitted: Future):
        self._submitted = submitted  # resolves to the PrefectDaskFuture

    @property
    def future(self) -> Any:
        """The Prefect future (waits for the submit)."""
        return self._submitted.result()

    @property
    def key(self) -> str | None:
        """The Dask key; None until the submit has returned (or when it failed)."""
        if not self._submitted.done() or self._submitted.exception() is not None:
            return None
        return self._submitted.result().wrapped_future.key

    def done(self) -> bool:
        if not self._submitted.done():
            return False
        if self._submitted.exception() is not None:
            return True
        return self._submitted.result().wrapped_future.done()

    def cancel(self) -> None:
        def cancel(f: Future) -> None:
            if f.exception() is None:
                f.result().wrapped_future.cancel()

        self._submitted.add_done_callback(cancel)

    def result(self, timeout: float | None = None) -> Any:
        t0 = time.monotonic()
        fut = self._submitted.result(timeout=timeout)
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
        return fut.result(timeout=left)

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """``fn()`` once the task has ended (or its submit failed), on whichever thread
        saw it end; at once if it already has."""

        def submitted(f: Future) -> None:
            if f.exception() is not None:
                fn()
                return
            f.result().wrapped_future.add_done_callback(lambda _f: fn())

        self._submitted.add_done_callback(submitted)


class Submits:
    """One thread that makes Prefect task submits in the creating thread's context (the
    flow run's: create it in the flow), in priority then request order; ``close`` ends it
    after the queue."""

    def __init__(self) -> None:
        self._ctx = contextvars.copy_context()  # the flow run's, tags, settings
        self.stats = SubmitStats()
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._thread = threading.Thread(target=self._run, name="gyre-submit", daemon=True)
        self._thread.start()

    def submit(self, priority: int, fn: Callable[..., Any], *args: Any) -> PendingJob:
        """``fn(*args)`` (a Prefect ``task.submit``) on the submit thread, in the flow run's
        context, under the Dask annotations the calling thread has entered."""
        done: Future = Future()
        ann = dask.get_annotations()
        self._q.put((priority, next(self._seq), time.monotonic(), ann, fn, args, done))
        return PendingJob(done)

    def _run(self) -> None:
        while True:
            priority, _, t_asked, ann, fn, args, done = self._q.get()
            if fn is None:
                return
            t0 = time.monotonic()
            try:
                done.set_result(self._ctx.copy().run(_annotated, ann, fn, args))
            except BaseException as exc:  # the executor sees it on the job (the run stops)
                log.warning("a %s submit failed: %s", KIND[priority], exc)
                done.set_exception(exc)
            self.stats.add(KIND[priority], t0 - t_asked, time.monotonic() - t0)

    def close(self, timeout: float = 60.0) -> None:
        """End the thread once the submits already asked for are made (bounded)."""
        self._q.put((99, next(self._seq), 0.0, None, None, (), None))
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("Prefect submits still queued %.0f s after the run's end", timeout)


def _annotated(ann: dict[str, Any], fn: Callable[..., Any], args: tuple) -> Any:
    if not ann:
        return fn(*args)
    with dask.annotate(**ann):
        return fn(*args)
