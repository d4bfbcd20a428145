"""Prefect task: TITO records of one step's rollouts -> trees, node index, rewards, samples.

Reads the step's records and scores from the store, composes the pure
trajectory processor (tasks/tree.py, tasks/scoring.py, tasks/sampler.py) and
writes the ``nodes``, ``rollouts`` and ``samples`` datasets. Returns a small
handle (the samples segment path and counts), never tensors.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from prefect import task
from prefect.logging import get_run_logger

from storage.store import Store
from storage.tito import TitoRecord
from tasks.handles import ProcessedStep, SessionHandle
from tasks.train.config import TrainConfig
from tasks.trajectory.sampler import Sample, build_samples, zero_variance_groups
from tasks.trajectory.scoring import Score, score_rollout, scores_at_requests
from tasks.trajectory.tree import build_trees, root_session


def _rows_for_sessions(
    store: Store, dataset: str, session_ids: list[str], since_ns: int | None
) -> list[dict[str, Any]]:
    table = store.read(dataset, since_ns)
    if table.num_rows == 0:
        return []
    mask = pc.is_in(table["session_id"], value_set=pa.array(session_ids))
    return table.filter(mask).to_pylist()


def process_sessions(
    store: Store,
    run_id: str,
    step: int,
    sessions: list[SessionHandle],
    *,
    current_version: int,
    since_ns: int | None = None,
    reward_aggregation: str = "weighted_mean",
    advantage: str = "grpo",
    max_staleness: int | None = None,
    stale_policy: str = "drop",
    normalize_std: bool = True,
    filter_zero_variance: bool = True,
) -> ProcessedStep:
    """The body of ``process_step`` (callable without Prefect, e.g. in tests).

    ``since_ns``: the sessions' records and scores were written after this time, so
    older segments are not read (None reads everything).
    """
    sids = [s.session_id for s in sessions]
    records = [TitoRecord.from_row(r) for r in _rows_for_sessions(store, "tito", sids, since_ns)]
    scores = [
        Score(**{k: r[k] for k in Score.__dataclass_fields__})
        for r in _rows_for_sessions(store, "scores", sids, since_ns)
    ]
    parents = {s.session_id: s.parent_session_id for s in sessions if s.parent_session_id}
    trees = build_trees(records, session_parents=parents)
    at = scores_at_requests(scores)
    node_rows = [row for t in trees.values() for row in t.node_rows(run_id, at)]
    store.append("nodes", node_rows)

    def root(sid: str) -> str:  # the top-level session a sub-agent session works for
        return root_session(parents, sid)

    # a rollout is judged on what it and its sub-agents finished
    family_scores = [replace(sc, session_id=root(sc.session_id)) for sc in scores]
    rewards: dict[str, float] = {}
    for s in sessions:
        if root(s.session_id) == s.session_id:
            rewards[s.session_id] = score_rollout(
                run_id,
                s.session_id,
                family_scores,
                declared=s.subtasks or None,
                status=s.status,
                reason=s.reason,
                aggregation=reward_aggregation,
            ).reward
    by_sid: dict[str, list[TitoRecord]] = {}
    for r in records:
        by_sid.setdefault(r.session_id, []).append(r)
    rollout_rows = []
    for s in sessions:
        sid = s.session_id
        recs = by_sid.get(sid, [])
        flat = sum(trees[sid].context_len(r.request_id) for r in recs) if sid in trees else 0
        rollout_rows.append(
            {
                "run_id": run_id,
                "session_id": sid,
                "group_id": s.group_id,
                "step": step,
                "task_id": s.task_id,
                "status": s.status,
                "reward": rewards.get(root(sid), 0.0),
                "n_calls": len(recs),
                "n_tokens_unique": sum(len(r.new_input_ids) + len(r.output_ids) for r in recs),
                "n_tokens_flat": flat,
                "reason": s.reason,
                "parent_session_id": s.parent_session_id,
            }
        )
    store.append("rollouts", rollout_rows)

    groups = {s.session_id: s.group_id for s in sessions if s.session_id in rewards}
    samples = build_samples(
        trees,
        rewards,
        groups,
        run_id=run_id,
        step=step,
        advantage=advantage,
        scores=scores,
        current_version=current_version,
        max_staleness=max_staleness,
        stale_policy=stale_policy,
        normalize_std=normalize_std,
        filter_zero_variance=filter_zero_variance,
    )
    flat = zero_variance_groups(
        rewards, groups, advantage=advantage, scores=scores, normalize_std=normalize_std
    )
    seg = store.append("samples", [_sample_row(s) for s in samples])
    return ProcessedStep(
        step=step,
        samples_segment=seg,
        sample_ids=tuple(s.sample_id for s in samples),
        n_samples=len(samples),
        n_calls=len(records),
        n_nodes=len(node_rows),
        tokens_unique=int(sum(r["n_tokens_unique"] for r in rollout_rows)),
        tokens_flat=int(sum(r["n_tokens_flat"] for r in rollout_rows)),
        reward_mean=float(np.mean(list(rewards.values()))) if rewards else 0.0,
        zero_variance_groups=len(flat),
        version_min=min(
            (int(s.versions[s.versions >= 0].min()) for s in samples if (s.versions >= 0).any()),
            default=-1,
        ),
    )


def _sample_row(s: Sample) -> dict[str, Any]:
    """The stored row: the sample plus the policy versions of its trainable tokens."""
    v = s.versions[(s.versions >= 0) & s.trainable_mask]
    lo, hi = (int(v.min()), int(v.max())) if v.size else (-1, -1)
    return {**s.to_row(), "version_min": lo, "version_max": hi}


@task(name="process-group", task_run_name="process-g{index}")
def process_group(
    store: Store,
    run_id: str,
    index: int,
    step: int,
    sessions: list[SessionHandle],
    current_version: int,
    cfg: TrainConfig,
    since_ns: int | None = None,
) -> ProcessedStep:
    """Trees, scores and samples of one finished group, as soon as it finished (streaming).

    Staleness is not judged here: the lag of a sample is known only when a step takes it,
    and the step enforces the bound (tasks/train_step.py).
    """
    out = process_sessions(
        store,
        run_id,
        step,
        sessions,
        current_version=current_version,
        since_ns=since_ns,
        reward_aggregation=cfg.reward_aggregation,
        advantage=cfg.advantage,
        max_staleness=None,
        normalize_std=cfg.normalize_std,
        filter_zero_variance=cfg.filter_zero_variance,
    )
    get_run_logger().info(
        "group %d: %d calls -> %d samples; unique/flat tokens %d/%d; reward %.3f",
        index,
        out.n_calls,
        out.n_samples,
        out.tokens_unique,
        out.tokens_flat,
        out.reward_mean,
    )
    return out
