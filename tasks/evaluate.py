"""Prefect task: held-out evaluation of one policy version through the gateway.

One session per held-out task seed (tasks/env/heldout.py), run by the run's harness against
the run's gateway like a training rollout, but greedy (temperature 0) and with
``eval.max_attempts`` tries per turn, every session placed on ``cell_id`` (a rollout cell
whose engine serves exactly ``version``; flows/evaluation.py keeps it there until the
evaluation ends). Sessions are created with ``meta.eval = true`` and group ``eval-v{N}``;
they are never handed to processing, so they never become training samples (their calls are
in ``tito`` like every call; their scores go to ``evals``, not to ``scores``).

Each session's sub-task scores and its reward (the run's ``train.reward_aggregation``) are
appended to the ``evals`` dataset (storage/schemas.py), one row per task.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from prefect import task
from prefect.logging import get_run_logger

from storage.store import Store
from tasks.env.config import RolloutConfig
from tasks.env.harness import make_harness
from tasks.env.heldout import EvalConfig
from tasks.env.suite import HarnessContext, load_suite
from tasks.rollout import admin_token, harness_settings, new_session, run_session, score_env
from tasks.trajectory.scoring import Score, score_rollout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalDone:
    """One finished evaluation: what it measured (the rows are in ``evals``)."""

    version: int
    step: int
    n: int
    reward_mean: float
    session_ids: tuple[str, ...]
    seconds: float


def evaluate_version(
    gateway_url: str,
    admin_token: str,
    store: Store,
    run_id: str,
    *,
    version: int,
    step: int,
    cell_id: str | None,
    seeds: list[int],
    rollout: RolloutConfig,
    cfg: EvalConfig,
    aggregation: str = "weighted_mean",
) -> EvalDone:
    """The body of ``evaluate_policy`` (callable without Prefect)."""
    t0 = time.time()
    suite = load_suite(rollout.suite, **rollout.suite_options())
    harness = make_harness(rollout.harness)
    settings = dataclasses.replace(
        harness_settings(rollout, 0),
        temperature=0.0,
        top_p=1.0,
        max_attempts=cfg.max_attempts,
        timeout_s=cfg.timeout_s,
    )
    root = tempfile.mkdtemp(prefix=f"gyre-eval-v{version}-")

    def one(seed: int) -> dict[str, Any]:
        task_ = suite.task(seed)
        env = suite.start(task_, tempfile.mkdtemp(prefix=f"e{seed}-", dir=root))
        s0 = time.time()
        try:
            sid, key = new_session(
                gateway_url,
                admin_token,
                f"eval-v{version}",
                {"eval": True, "version": version, "task_id": task_.task_id, "cell_id": cell_id},
            )
            ctx = HarnessContext(gateway_url, key, env, dataclasses.replace(settings, seed=seed))
            outcome = asyncio.run(run_session(harness, ctx, cfg.timeout_s))
            scored = score_env(suite, env, outcome)
        finally:
            try:
                env.close()
            except Exception:
                log.exception("closing an evaluation environment failed")
        rs = score_rollout(
            run_id,
            sid,
            [Score(run_id, sid, **s.row()) for s in scored],
            declared=task_.weights,
            status=outcome.status,
            reason=outcome.reason,
            aggregation=aggregation,
        )
        return {
            "run_id": run_id,
            "version": version,
            "step": step,
            "seed": seed,
            "task_id": task_.task_id,
            "session_id": sid,
            "cell_id": cell_id,
            "status": outcome.status,
            "reason": outcome.reason,
            "reward": float(rs.reward),
            "n_calls": outcome.calls,
            "subtask_ids": [s.subtask_id for s in scored],
            "subtask_scores": [float(s.score) for s in scored],
            "t": time.time(),
            "seconds": time.time() - s0,
        }

    try:
        with ThreadPoolExecutor(max_workers=min(cfg.concurrency, len(seeds))) as pool:
            rows = list(pool.map(one, seeds))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    store.append("evals", rows)
    mean = sum(r["reward"] for r in rows) / len(rows) if rows else 0.0
    return EvalDone(
        version, step, len(rows), mean, tuple(r["session_id"] for r in rows), time.time() - t0
    )


@task(name="evaluate", task_run_name="evaluate-v{version}")
def evaluate_policy(
    gateway_url: str,
    admin_token_var: str,
    store: Store,
    run_id: str,
    version: int,
    step: int,
    cell_id: str | None,
    seeds: list[int],
    rollout: RolloutConfig,
    cfg: EvalConfig,
    aggregation: str = "weighted_mean",
) -> EvalDone:
    """Held-out reward of policy ``version``: one greedy session per seed on ``cell_id``.

    ``admin_token_var``: the Dask Variable holding the gateway's admin token."""
    done = evaluate_version(
        gateway_url,
        admin_token(admin_token_var),
        store,
        run_id,
        version=version,
        step=step,
        cell_id=cell_id,
        seeds=seeds,
        rollout=rollout,
        cfg=cfg,
        aggregation=aggregation,
    )
    get_run_logger().info(
        "held-out v%d: %d tasks, reward %.3f in %.1fs",
        version,
        done.n,
        done.reward_mean,
        done.seconds,
    )
    return done
