"""Prefect task: roll out one group (one task, ``group_size`` sessions) through the gateway.

Each session gets its own API key from the gateway; the harness sees only the
base URL and the key. The environment's sub-task scores are written to the
store whatever happens: a failed or timed-out session is scored on what it
finished, with the reason recorded.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from prefect import task
from prefect.logging import get_run_logger

from storage.store import Store
from tasks.env.arith import ArithEnv
from tasks.env.config import RolloutConfig
from tasks.env.harness import run_agent
from tasks.handles import SessionHandle


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


async def _run_session(
    gateway_url: str, key: str, env: ArithEnv, cfg: RolloutConfig, seed: int
) -> dict[str, Any]:
    status, reason, calls = "finished", "", 0
    try:
        res = await asyncio.wait_for(
            run_agent(
                gateway_url,
                key,
                env,
                max_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                seed=seed,
                max_attempts=cfg.max_attempts,
                summarize_every=cfg.summarize_every,
            ),
            timeout=cfg.timeout_s,
        )
        calls = res.calls
    except TimeoutError:
        status, reason = "timeout", f"rollout exceeded {cfg.timeout_s}s"
        env.mark("timeout", reason)
    except Exception as exc:  # the harness is a black box: record, never drop
        status, reason = "failed", f"{type(exc).__name__}: {exc}"[:500]
        env.mark("failed", reason)
    env.mark("unfinished", "session ended before this sub-task")
    return {"status": status, "reason": reason, "calls": calls}


@task(name="rollout-group", task_run_name="rollout-{group_id}")
def rollout_group(
    gateway_url: str,
    admin_token: str,
    store: Store,
    run_id: str,
    step: int,
    group_id: str,
    task_seed: int,
    cfg: dict[str, Any],
) -> list[dict[str, Any]]:
    """Run ``cfg.group_size`` sessions of one task concurrently; returns small handles."""
    logger = get_run_logger()
    envs, keys, sids = [], [], []
    for i in range(cfg.group_size):
        env = ArithEnv.create(task_seed, cfg.subtasks)
        sid, key = new_session(
            gateway_url, admin_token, group_id, {"step": step, "task_id": env.task_id, "member": i}
        )
        envs.append(env)
        keys.append(key)
        sids.append(sid)

    async def _all():
        return await asyncio.gather(
            *[
                _run_session(gateway_url, k, e, cfg, seed=cfg.seed * 100_003 + task_seed * 101 + i)
                for i, (k, e) in enumerate(zip(keys, envs, strict=True))
            ]
        )

    t0 = time.monotonic()
    outcomes = asyncio.run(_all())
    rows = []
    handles = []
    for sid, env, out in zip(sids, envs, outcomes, strict=True):
        for r in env.score_rows():
            rows.append({"run_id": run_id, "session_id": sid, **r})
        handles.append(
            SessionHandle(
                session_id=sid,
                group_id=group_id,
                task_id=env.task_id,
                step=step,
                status=out["status"],
                subtasks={t.subtask_id: t.weight for t in env.subtasks},
                reason=out["reason"],
                calls=out["calls"],
            )
        )
    store.append("scores", rows)
    n_calls = sum(h.calls for h in handles)
    bad = [h for h in handles if h.status != "finished"]
    logger.info(
        "group %s: %d sessions, %d calls in %.1fs%s",
        group_id,
        len(handles),
        n_calls,
        time.monotonic() - t0,
        f", {len(bad)} not finished" if bad else "",
    )
    return handles
