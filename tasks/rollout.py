"""Prefect task: roll out one group (one task, ``group_size`` sessions) through the gateway.

The task comes from the configured suite (``rollout.suite``, tasks/env/suite.py); each
session gets its own environment, its own private directory and its own API key from the
gateway; the harness (``rollout.harness``) sees only the base URL and the key. The
suite's evaluator scores every session whatever happened, and the scores are written to
the store: a failed or timed-out session is scored on what it finished, with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
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
from tasks.handles import SessionHandle

log = logging.getLogger(__name__)


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


async def _run_session(harness, ctx: HarnessContext, timeout_s: float) -> Outcome:
    try:
        res = await asyncio.wait_for(harness(ctx), timeout=timeout_s)
        return Outcome("finished", "", getattr(res, "calls", 0) or 0)
    except TimeoutError:
        return Outcome("timeout", f"rollout exceeded {timeout_s}s")
    except Exception as exc:  # the harness is a black box: record, never drop
        return Outcome("failed", f"{type(exc).__name__}: {exc}"[:500])


def _evaluate(suite, env, outcome: Outcome) -> list[SubtaskScore]:
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


def rollout_sessions(
    gateway_url: str,
    admin_token: str,
    store: Store,
    run_id: str,
    step: int,
    group_id: str,
    task_seed: int,
    cfg: RolloutConfig,
) -> list[SessionHandle]:
    """The body of ``rollout_group`` (callable without Prefect, e.g. in tests)."""
    suite = load_suite(cfg.suite, **cfg.suite_options())
    harness = make_harness(cfg.harness)
    task_ = suite.task(task_seed)
    root = tempfile.mkdtemp(prefix=f"gyre-{group_id}-")
    envs, keys, sids = [], [], []
    try:
        for i in range(cfg.group_size):
            workdir = tempfile.mkdtemp(prefix=f"s{i}-", dir=root)
            env = suite.start(task_, workdir)
            if i == 0 and (problems := check_env(env)):
                raise SuiteError([f"rollout.suite={cfg.suite!r}: {p}" for p in problems])
            sid, key = new_session(
                gateway_url,
                admin_token,
                group_id,
                {"step": step, "task_id": task_.task_id, "member": i},
            )
            envs.append(env)
            keys.append(key)
            sids.append(sid)

        async def _all():
            return await asyncio.gather(
                *[
                    _run_session(
                        harness,
                        HarnessContext(
                            gateway_url,
                            k,
                            e,
                            harness_settings(cfg, cfg.seed * 100_003 + task_seed * 101 + i),
                        ),
                        cfg.timeout_s,
                    )
                    for i, (k, e) in enumerate(zip(keys, envs, strict=True))
                ]
            )

        outcomes = asyncio.run(_all())
        with ThreadPoolExecutor(max_workers=min(4, len(envs))) as pool:
            scored = list(
                pool.map(lambda eo: _evaluate(suite, *eo), zip(envs, outcomes, strict=True))
            )
    finally:
        for env in envs:
            try:
                env.close()
            except Exception:
                log.exception("closing an environment failed")
        shutil.rmtree(root, ignore_errors=True)
    rows, handles = [], []
    for sid, out, scores in zip(sids, outcomes, scored, strict=True):
        rows += [{"run_id": run_id, "session_id": sid, **s.row()} for s in scores]
        handles.append(
            SessionHandle(
                session_id=sid,
                group_id=group_id,
                task_id=task_.task_id,
                step=step,
                status=out.status,
                subtasks=task_.weights,
                reason=out.reason,
                calls=out.calls,
            )
        )
    store.append("scores", rows)
    return handles


@task(name="rollout-group", task_run_name="rollout-{group_id}")
def rollout_group(
    gateway_url: str,
    admin_token: str,
    store: Store,
    run_id: str,
    step: int,
    group_id: str,
    task_seed: int,
    cfg: RolloutConfig,
) -> list[SessionHandle]:
    """Run ``cfg.group_size`` sessions of one task concurrently; returns small handles."""
    t0 = time.monotonic()
    handles = rollout_sessions(
        gateway_url, admin_token, store, run_id, step, group_id, task_seed, cfg
    )
    n_calls = sum(h.calls for h in handles)
    bad = [h for h in handles if h.status != "finished"]
    get_run_logger().info(
        "group %s: %d sessions, %d calls in %.1fs%s",
        group_id,
        len(handles),
        n_calls,
        time.monotonic() - t0,
        f", {len(bad)} not finished" if bad else "",
    )
    return handles
