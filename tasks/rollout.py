"""Prefect task: roll out one group (one task, ``group_size`` sessions) through the gateway.

The task comes from the configured suite (``rollout.suite``, tasks/env/suite.py); each
session gets its own environment, its own private directory and its own API key from the
gateway; the harness (``rollout.harness``) sees only the base URL and the key. The
suite's evaluator scores every session whatever happened, and the scores are written to
the store: a failed, timed-out or stopped session is scored on what it finished, with
the reason.

Sessions run on threads of their own, so an environment that takes its time between two
model calls (``GroupSpec.env_step_s``: a tool, a test run) holds up only its own session.
A run that ends stops its rollouts cooperatively: each session checks the run's stop event
at its next environment step (a Prefect cancel does not stop a running Dask task).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from prefect import task
from prefect.logging import get_run_logger

from storage.store import Store
from tasks.env.config import RolloutConfig
from tasks.env.harness import make_harness
from tasks.env.suite import (
    HarnessContext,
    HarnessSettings,
    Outcome,
    SubtaskScore,
    SuiteError,
    check_env,
    load_suite,
)
from tasks.handles import GroupSpec, SessionHandle

log = logging.getLogger(__name__)


class Stopped(Exception):
    """The run is over: the session ends at this environment step (scored as unfinished)."""


def new_session(
    gateway_url: str, admin_token: str, group_id: str, meta: dict[str, Any]
) -> tuple[str, str]:
    """Mint a session id and API key from the gateway's admin endpoint."""
    r = httpx.post(
        f"{gateway_url}/gyre/sessions",
        json={"group_id": group_id, "meta": meta},
        headers={"Authorization": f"Bearer {admin_token}"},
        timeout=30,
    )
    r.raise_for_status()
    body = r.json()
    return body["session_id"], body["api_key"]


def harness_settings(cfg: RolloutConfig, seed: int) -> HarnessSettings:
    return HarnessSettings(
        max_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        seed=seed,
        max_attempts=cfg.max_attempts,
        max_tool_rounds=cfg.max_tool_rounds,
        summarize_every=cfg.summarize_every,
        context_tokens=cfg.context_tokens,
        context_policy=cfg.context_policy,
        timeout_s=cfg.timeout_s,
    )


class SlowEnv:
    """An environment whose every step (a graded answer, a tool call) takes time: a
    log-normal draw around ``median_s``, long-tailed by ``sigma`` (pacing of the world the
    agent acts in). Checks ``stopped()`` first, so a finished run ends its sessions.


    A paced session (``until``: a list of deadlines, wall clock): its ``k``-th step ends at
    ``until[k]`` (or at once past the last), however long the model call before it took:
    the session holds its slot for a given duration with a call at every interval.
    """

    def __init__(
        self,
        env: Any,
        median_s: float,
        sigma: float,
        seed: int,
        stopped=None,
        until: list[float] | None = None,
    ):
        self._env = env
        self._median, self._sigma = median_s, sigma
        self._rng = random.Random(seed)
        self._stopped = stopped or (lambda: False)
        self._until = list(until or [])
        self._k = 0

    def _step(self) -> None:
        if self._stopped():
            raise Stopped("the run ended")
        if self._until:
            t = self._until[min(self._k, len(self._until) - 1)]
            self._k += 1
            while (left := t - time.time()) > 0:
                if self._stopped():
                    raise Stopped("the run ended")
                time.sleep(min(left, 1.0))
        elif self._median > 0:
            time.sleep(self._median * math.exp(self._sigma * self._rng.gauss(0.0, 1.0)))

    def submit(self, *args, **kwargs):
        self._step()
        return self._env.submit(*args, **kwargs)

    def call_tool(self, *args, **kwargs):
        self._step()
        return self._env.call_tool(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._env, name)


def paced_calls(duration_s: float, call_s: float) -> int:
    """Model calls of a paced session: one at the start of every ``call_s`` of its
    ``duration_s`` (a call's end is a boundary where the session may move)."""
    return max(1, math.ceil(duration_s / call_s - 1e-9)) if call_s > 0 else 1


async def run_session(harness, ctx: HarnessContext, timeout_s: float) -> Outcome:
    """Run one session of the harness against the gateway; never raises (the harness is a
    black box: record, never drop)."""
    try:
        res = await asyncio.wait_for(harness(ctx), timeout=timeout_s)
        return Outcome("finished", "", getattr(res, "calls", 0) or 0)
    except TimeoutError:
        return Outcome("timeout", f"rollout exceeded {timeout_s}s")
    except Stopped as exc:
        return Outcome("unfinished", str(exc))
    except Exception as exc:  # the harness is a black box: record, never drop
        return Outcome("failed", f"{type(exc).__name__}: {exc}"[:500])


def score_env(suite, env, outcome: Outcome) -> list[SubtaskScore]:
    """The suite's scores; an evaluator that raises still yields a row per sub-task."""
    try:
        return list(suite.evaluate(env, outcome))
    except Exception as exc:
        reason = f"evaluator raised {type(exc).__name__}: {exc}"[:500]
        log.exception("evaluating %s failed", env.task.task_id)
        return [
            SubtaskScore(s.subtask_id, 0.0, s.weight, None, "failed", reason, "evaluator")
            for s in env.task.subtasks
        ]


def _watch_stop(ev: Any, stop: threading.Event, done: threading.Event) -> None:
    """Poll the run's distributed stop event ``ev`` once a second until ``done``; mirror it
    into ``stop`` (a plain flag the session threads read for free)."""
    while not done.wait(1.0):
        try:
            if ev.is_set():
                stop.set()
                return
        except Exception as exc:  # the scheduler is unreachable: keep going, say so
            log.warning("stop event unreadable: %s", exc)


def roll_out_group(
    gateway_url: str,
    admin_token: str,
    store: Store,
    run_id: str,
    spec: GroupSpec,
    cfg: RolloutConfig,
    stop_event: str | None = None,
) -> list[SessionHandle]:
    """The body of ``rollout_group`` (callable without Prefect)."""
    until: list[float] | None = None
    n_sub = spec.subtasks or cfg.subtasks
    if spec.duration_s > 0:  # paced: a call every call_s from the group's start, for duration_s
        n_sub = paced_calls(spec.duration_s, spec.call_s)
        t0 = spec.t_start or time.time()
        until = [t0 + min(spec.duration_s, (k + 1) * spec.call_s) for k in range(n_sub)]
    options = {**cfg.suite_options(), "subtasks": n_sub}
    suite = load_suite(cfg.suite, **options)
    harness = make_harness(cfg.harness)
    task_ = suite.task(spec.task_seed)
    root = tempfile.mkdtemp(prefix=f"gyre-{spec.group_id}-")
    stop, done = threading.Event(), threading.Event()
    envs, keys, sids = [], [], []
    outcomes: list[Outcome | None] = []
    try:
        for i in range(cfg.group_size):
            workdir = tempfile.mkdtemp(prefix=f"s{i}-", dir=root)
            env = suite.start(task_, workdir)
            envs.append(env)
            if i == 0 and (problems := check_env(env)):
                raise SuiteError([f"rollout.suite={cfg.suite!r}: {p}" for p in problems])
            sid, key = new_session(
                gateway_url,
                admin_token,
                spec.group_id,
                {
                    "step": spec.step,
                    "task_id": task_.task_id,
                    "member": i,
                    "group": spec.index,
                    "cell_id": spec.cell_id,  # the gateway starts the session there
                },
            )
            keys.append(key)
            sids.append(sid)
        outcomes = [None] * len(envs)

        def one(i: int) -> None:
            seed = cfg.seed * 100_003 + spec.task_seed * 101 + i
            env = SlowEnv(envs[i], spec.env_step_s, spec.env_step_sigma, seed, stop.is_set, until)
            ctx = HarnessContext(gateway_url, keys[i], env, harness_settings(cfg, seed))
            outcomes[i] = asyncio.run(run_session(harness, ctx, cfg.timeout_s))

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(envs))]
        for t in threads:
            t.start()
        watcher = None
        if stop_event:
            from distributed import Event, get_client

            # the worker's client, taken on the task's thread (another thread cannot find it)
            ev = Event(stop_event, client=get_client())
            watcher = threading.Thread(target=_watch_stop, args=(ev, stop, done), daemon=True)
            watcher.start()
        for t in threads:  # run_session bounds itself (cfg.timeout_s); the join adds a margin
            t.join(timeout=cfg.timeout_s + 60)
        done.set()
        if watcher is not None:
            watcher.join(timeout=5)
        final = [o or Outcome("failed", "session thread did not end") for o in outcomes]
        with ThreadPoolExecutor(max_workers=min(4, len(envs))) as pool:
            scored = list(pool.map(lambda eo: score_env(suite, *eo), zip(envs, final, strict=True)))
    finally:
        done.set()
        for env in envs:
            try:
                env.close()
            except Exception:
                log.exception("closing an environment failed")
        shutil.rmtree(root, ignore_errors=True)
    rows, handles = [], []
    for sid, out, scores in zip(sids, final, scored, strict=True):
        rows += [{"run_id": run_id, "session_id": sid, **s.row()} for s in scores]
        handles.append(
            SessionHandle(
                session_id=sid,
                group_id=spec.group_id,
                task_id=task_.task_id,
                step=spec.step,
                status=out.status,
                subtasks=task_.weights,
                reason=out.reason,
                calls=out.calls,
            )
        )
    store.append("scores", rows)
    return handles


class RolloutsFailed(RuntimeError):
    """More than ``rollout.max_failed_fraction`` of a step's sessions failed."""


class FailedSessions:
    """Failed sessions per step, against ``rollout.max_failed_fraction``.

    A step's sessions are its ``groups_per_step x group_size`` rollout sessions (the
    handles of its groups, by ``SessionHandle.step``); a session ``failed`` when its harness
    raised (a broken agent: a wrong model name, a crash), not when it timed out or the run
    ended first. As soon as the failures of one step pass the fraction of the step's
    sessions, ``error`` names the step and the first reasons and ``check`` raises
    ``RolloutsFailed``, so a broken agent stops the run at its first step instead of
    training on nothing."""

    def __init__(self, cfg: RolloutConfig):
        self.per_step = cfg.groups_per_step * cfg.group_size
        self.max_fraction = cfg.max_failed_fraction
        self.failed: dict[int, list[SessionHandle]] = {}
        self.n_sessions = 0
        self.n_failed = 0
        self.error: str | None = None  # the first step past the bound, with its reasons

    def add(self, handles: list[SessionHandle]) -> None:
        for h in handles:
            self.n_sessions += 1
            if h.status == "failed":
                self.n_failed += 1
                self.failed.setdefault(h.step, []).append(h)
        for step in sorted({h.step for h in handles}):
            bad = self.failed.get(step, [])
            if self.error is None and len(bad) > self.max_fraction * self.per_step:
                reasons = list(dict.fromkeys(h.reason or "(no reason)" for h in bad))
                first = "; ".join(repr(r) for r in reasons[:3])  # each at most 500 chars
                self.error = (
                    f"step {step}: {len(bad)} of its {self.per_step} sessions failed, more "
                    f"than rollout.max_failed_fraction={self.max_fraction:g}; first reasons: "
                    f"{first}. Check the agent (rollout.harness) against the gateway; the "
                    "reasons of all are in the rollouts dataset (status 'failed')"
                )

    def check(self) -> None:
        if self.error is not None:
            raise RolloutsFailed(self.error)


def admin_token_variable(run_id: str) -> str:
    """The Dask Variable holding a run's gateway admin token. Secrets travel to the cells
    through the cluster's scheduler, never as Prefect parameters (which the UI shows)."""
    return f"gyre-admin-token-{run_id}"


def admin_token(variable: str, timeout_s: float = 60.0) -> str:
    """The admin token a run's flow put in the Dask Variable ``variable``."""
    from distributed import Variable, get_client

    return Variable(variable, client=get_client()).get(timeout=timeout_s)


@task(name="rollout-group", task_run_name="rollout-{spec.group_id}")
def rollout_group(
    gateway_url: str,
    admin_token_var: str,
    store: Store,
    run_id: str,
    spec: GroupSpec,
    cfg: RolloutConfig,
    stop_event: str | None = None,
) -> list[SessionHandle]:
    """Run ``cfg.group_size`` sessions of one task concurrently; returns small handles.

    ``admin_token_var``: the name of the Dask Variable holding the gateway's admin token."""
    t0 = time.monotonic()
    token = admin_token(admin_token_var)
    handles = roll_out_group(gateway_url, token, store, run_id, spec, cfg, stop_event)
    bad = [h for h in handles if h.status != "finished"]
    get_run_logger().info(
        "group %s: %d sessions, %d calls in %.1fs%s",
        spec.group_id,
        len(handles),
        sum(h.calls for h in handles),
        time.monotonic() - t0,
        f", {len(bad)} not finished" if bad else "",
    )
    return handles
