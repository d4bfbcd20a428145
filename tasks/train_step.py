"""Prefect task: one member's part of a data-parallel optimizer step, then (rank 0) publish.

The trainer replica (model + optimizer) stays in the cell's process between steps. A step
over ``k`` train cells is ``k`` tasks, one pinned to each member (tasks/train/dp.py):
members form the step's DP generation (a new one when the membership changed), a member
that lacks the start version receives model and optimizer state from one that holds it (or
all load the checkpoint), each trains a token-balanced shard with the whole batch's
normaliser, gradients are summed over members, every member applies the same update.

Rank 0 then commits the step: the checkpoint of the new version, the ``ledger`` (which
samples the step consumed, with each one's policy lag) and the ``steps`` row, as one atomic
write (storage/commits.py: a crash before it leaves nothing, a crash after it leaves a
committed step). A step whose samples are already in the ledger is refused, so a retried or
replayed step never trains a sample twice. The lag bound (``train.max_staleness``) is enforced here, at the version the
step starts from: older tokens are dropped (``stale_policy=drop``) or importance-corrected
(``is``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import tempfile
import time
from dataclasses import replace
from typing import Any

import numpy as np
from prefect import task
from prefect.logging import get_run_logger

from infra.cells.cluster import cell_name, host_of, this_cell
from storage.checkpoints import (
    SHARDED_DIR,
    checkpoint_relpath,
    fetch_checkpoint,
    latest_version,
    stage_checkpoint,
)
from storage.commits import commit_step_record, roll_forward
from storage.store import Store, StoreError
from tasks.handles import TrainedStep
from tasks.train import dp, sharded
from tasks.train.config import TrainConfig
from tasks.train.trainer import STATE_FILE, Trainer
from tasks.trajectory.sampler import Sample

log = logging.getLogger(__name__)


class LedgerError(RuntimeError):
    """Samples handed to a step were already consumed by an earlier step."""


def load_samples(store: Store, segment: str) -> list[Sample]:
    """The samples of one ``samples`` segment, read through the store's retries (an outage
    ends as the store's own `StoreError`, which the run names as such, not as a member's
    raw connection error); a segment that cannot be decoded is quarantined and refused."""
    table = store.read_segment(segment)
    if table is None:
        raise StoreError(
            f"store: samples segment {segment} cannot be decoded; it was moved to "
            "_quarantine/ and its samples are not trained"
        )
    return [Sample.from_row(r) for r in table.to_pylist()]


def sample_lag(sample: Sample, version: int) -> tuple[float, int, int]:
    """Policy lag of a sample trained from weights ``version``: (token-weighted mean, max,
    policy tokens). Policy tokens are those with a version (``>= 0``); (nan, -1, 0) if none."""
    v = sample.versions[sample.versions >= 0]
    if v.size == 0:
        return math.nan, -1, 0
    lag = version - v
    return float(lag.mean()), int(lag.max()), int(v.size)


def drop_stale(sample: Sample, version: int, max_lag: int) -> tuple[Sample, int]:
    """The sample with the tokens older than ``version - max_lag`` out of training, as the
    sampler's drop leaves them (tasks/trajectory/sampler.py, ``min_version``): no loss
    weight, no branch count (so neither the KL nor the entropy term sees them), and not in
    the loss normaliser ``n_flat_trainable`` nor in ``n_trainable``. Their context stays:
    later tokens see it. Returns the sample and how many trainable tokens were dropped.

    A token of lag ``max_lag`` is kept; one of ``max_lag + 1`` is dropped."""
    counts = sample.counts if sample.counts is not None else sample.trainable_mask
    trained = sample.trainable_mask | (counts > 0)
    old = (sample.versions >= 0) & (sample.versions < version - max_lag) & trained
    n = int(old.sum())
    if n == 0:
        return sample, 0
    wp, wn, cnt = sample.weight_pos.copy(), sample.weight_neg.copy(), counts.astype(np.int32)
    n_flat = int(cnt[old].sum())
    wp[old], wn[old], cnt[old] = 0.0, 0.0, 0
    return (
        replace(
            sample,
            weight_pos=wp,
            weight_neg=wn,
            counts=cnt,
            n_trainable=sample.n_trainable - n,
            n_flat_trainable=sample.n_flat_trainable - n_flat,
        ),
        n,
    )


def _trainer_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    return {
        "lr": cfg.lr,
        "loss": cfg.loss,
        "clip_eps_low": cfg.clip_eps_low,
        "clip_eps_high": cfg.clip_eps_high,
        "max_tokens_per_micro": cfg.max_tokens_per_micro,
        "seed": cfg.seed,
        "is_cap": cfg.is_cap,
        # "is": stale tokens reach the trainer and get truncated importance weights;
        # "drop": they lost their weight before (drop_stale)
        "max_staleness": cfg.max_staleness if cfg.stale_policy == "is" else None,
        # score tokens under the distribution they were sampled from (flows/config.py fills
        # these from the rollout section when unset)
        "temperature": cfg.temperature if cfg.temperature is not None else 1.0,
        "top_p": cfg.top_p if cfg.top_p is not None else 1.0,
        "kl_coef": cfg.kl_coef,
        "entropy_coef": cfg.entropy_coef,
    }


def _restore_kwargs(store: Store, run_id: str, cfg: TrainConfig) -> dict[str, Any]:
    kwargs = _trainer_kwargs(cfg)
    if cfg.kl_coef > 0:  # the KL term's reference: the run's first weights (the warm start)
        kwargs["ref_model_dir"] = fetch_checkpoint(store, run_id, 0)
    return kwargs


def restore_trainer(store: Store, run_id: str, version: int, cfg: TrainConfig) -> Trainer:
    """A replica at ``version`` from the store's checkpoint, optimizer state included."""
    path = fetch_checkpoint(store, run_id, version, with_optimizer=True)
    return Trainer.load(path, version=version, **_restore_kwargs(store, run_id, cfg))


def sharded_url(store: Store, run_id: str, version: int) -> str:
    """Where version ``version``'s sharded training state (DCP) lives: inside its checkpoint
    directory, staged before the marker commits it."""
    return store.full_url(f"{checkpoint_relpath(run_id, version)}/{SHARDED_DIR}")


def restore_sharded(
    store: Store, run_id: str, version: int, cfg: TrainConfig, group: dp.DPGroup
) -> tuple[Trainer, str]:
    """This member's shard of the trainer at ``version``, over ``group`` (collective): the
    consolidated weights, sharded over the group's mesh, then this member's shards of the
    committed step's weights and AdamW state (DCP reshards from any number of members).
    Returns ``(trainer, how)``: ``resharded``, or ``checkpoint`` when ``version`` has no
    sharded state (version 0, or one written with train.sharding=replicate: AdamW starts
    fresh, logged)."""
    path = fetch_checkpoint(store, run_id, version)
    trainer = Trainer(path, version=version, **_restore_kwargs(store, run_id, cfg))
    state = os.path.join(path, STATE_FILE)
    if os.path.isfile(state):
        with open(state) as fh:
            trainer.n_steps = int(json.load(fh).get("n_steps", 0))
    sharded.shard_trainer(trainer)
    rel = f"{checkpoint_relpath(run_id, version)}/{SHARDED_DIR}/.metadata"
    if not store.exists(rel):
        if version:
            log.warning(
                "v%d has no sharded state (written with train.sharding=replicate?): the "
                "sharded AdamW starts fresh",
                version,
            )
        return trainer, "checkpoint"
    return sharded.load_sharded(trainer, sharded_url(store, run_id, version)), "resharded"


def _sharded_trainer(
    store: Store, run_id: str, version: int, cfg: TrainConfig, group: dp.DPGroup, held: Any
) -> tuple[Trainer, str]:
    """The member's sharded trainer at ``version`` over ``group``: the held one when every
    member holds one at ``version`` on this group's mesh, else all rebuild (collective; the
    members agree first, since sharding and loading are collectives)."""
    mine = held is not None and sharded.is_sharded(held) and held.version == version
    if all(group.all_gather_ints(1 if mine else 0)):
        return held, "kept"
    return restore_sharded(store, run_id, version, cfg, group)


def stage_sharded(store: Store, run_id: str, trainer: Trainer) -> str | None:
    """Stage a sharded trainer's new version (collective, every member): its DCP state
    (each member its own shards) and the consolidated checkpoint the engine loads (the
    weights gathered to rank 0, with their digest). Returns the staged checkpoint's URL on
    rank 0 (which stages it after every member's shards are written), None elsewhere."""
    sharded.save_sharded(trainer, sharded_url(store, run_id, trainer.version))
    with tempfile.TemporaryDirectory(prefix="gyre-ckpt-") as tmp:
        if sharded.save_consolidated(trainer, tmp) is None:
            return None
        return stage_checkpoint(store, run_id, tmp, trainer.version)


def get_trainer(store: Store, run_id: str, cfg: TrainConfig, holder: Any = None) -> Trainer:
    """The cell's trainer replica at the newest version, restored from the store if needed."""
    version = latest_version(store, run_id)
    if version is None:
        raise FileNotFoundError(f"no checkpoint in {store.url}: publish v0 before training")
    key = (store.url, run_id, version)
    if holder is not None and holder.trainer is not None and holder.trainer_key == key:
        return holder.trainer
    trainer = restore_trainer(store, run_id, version, cfg)
    if holder is not None:
        holder.trainer, holder.trainer_key = trainer, key
    return trainer


def _check_ledger(store: Store, run_id: str, step: int, samples: list[Sample]) -> None:
    """Refuse samples an earlier committed step consumed (after completing the rows of a
    step whose commit a crash interrupted: storage/commits.py)."""
    roll_forward(store, run_id)
    ledger = store.read("ledger")
    if not ledger.num_rows:
        return
    done = {
        sid
        for rid, sid in zip(
            ledger["run_id"].to_pylist(), ledger["sample_id"].to_pylist(), strict=True
        )
        if rid == run_id
    }
    again = [s.sample_id for s in samples if s.sample_id in done]
    if again:
        raise LedgerError(f"step {step}: {len(again)} samples already trained, e.g. {again[0]!r}")


def commit_step(
    store: Store,
    run_id: str,
    step: int,
    trainer: Trainer,
    start_version: int,
    samples: list[Sample],
    metrics: dict[str, float],
    *,
    members: tuple[str, ...],
    t_start: float,
    generation: int = 0,
    mode: str = "",
    staged: str | None = None,
) -> TrainedStep:
    """Stage the new version's checkpoint (unless ``staged``: its URL, already staged, as a
    sharded step does), then commit it together with the step's ledger rows and ``steps``
    row in one atomic write (storage/commits.py)."""
    version = trainer.version
    if staged is not None:
        url = staged
    else:
        with tempfile.TemporaryDirectory(prefix="gyre-ckpt-") as tmp:
            trainer.save(tmp)
            url = stage_checkpoint(store, run_id, tmp, version)
    t1 = time.time()
    lags = [sample_lag(s, start_version) for s in samples]
    n_tok = sum(n for _, _, n in lags)
    lag_mean = sum(m * n for m, _, n in lags if n) / n_tok if n_tok else 0.0
    lag_max = max((x for _, x, n in lags if n), default=0)
    ledger = [
        {
            "run_id": run_id,
            "step": step,
            "sample_id": s.sample_id,
            "weight_version": version,
            "t": t1,
            "lag_mean": None if math.isnan(lm) else lm,
            "lag_max": lx if n else None,
        }
        for s, (lm, lx, n) in zip(samples, lags, strict=True)
    ]
    row = {
        "run_id": run_id,
        "step": step,
        "weight_version": version,
        "loss": metrics["train/loss"],
        "tokens": int(metrics["train/tokens"]),
        "trainable_tokens": int(metrics["train/trainable_tokens"]),
        "reward": metrics["train/reward_mean"],
        "n_samples": len(samples),
        "grad_norm": metrics["train/grad_norm"],
        "mean_staleness": lag_mean,
        "cells": list(members),
        "t_start": t_start,
        "t_end": t1,
        "checkpoint": url,
        "lag_mean": lag_mean,
        "lag_max": lag_max,
        "n_members": len(members),
        "generation": generation,
        "mode": mode,
        "dropped_tokens": int(metrics.get("train/dropped_stale_tokens", 0)),
    }
    commit_step_record(store, run_id, step, version, ledger, row)
    metrics = {**metrics, "train/lag_mean": lag_mean, "train/lag_max": float(lag_max)}
    return TrainedStep(step=step, weight_version=version, checkpoint=url, metrics=metrics)


def train_on_samples(
    store: Store,
    run_id: str,
    step: int,
    samples_segment: str | None,
    cfg: TrainConfig,
    *,
    holder: Any = None,
    cell_id: str = "local",
) -> TrainedStep:
    """One step on one member, without Prefect, Dask or a process group (tests, tools)."""
    t0 = time.time()
    samples = load_samples(store, samples_segment) if samples_segment else []
    _check_ledger(store, run_id, step, samples)
    trainer = get_trainer(store, run_id, cfg, holder)
    start = trainer.version
    metrics = trainer.step(samples)
    if holder is not None:
        holder.trainer_key = (store.url, run_id, trainer.version)
    return commit_step(
        store, run_id, step, trainer, start, samples, metrics, members=(cell_id,), t_start=t0
    )


# train/dp_sync: how a member came to the step's start version
SYNC_CODES = {"kept": 0.0, "broadcast": 1.0, "checkpoint": 2.0, "resharded": 3.0}


def member_step(
    store: Store,
    run_id: str,
    plan: dp.StepPlan,
    rank: int,
    cfg: TrainConfig,
    *,
    holder: Any,
    s_per_token: float = 0.0,
    timeout_s: float = 600.0,
    backend: str = "auto",
    mode: str = "",
) -> TrainedStep:
    """The body of ``train_member``: this member's part of ``plan`` (callable without Prefect).

    ``holder`` keeps the replica and the DP group between steps (the cell's plugin).
    ``s_per_token``: paced device time per forwarded token of this member's shard.
    """
    t0 = time.time()
    t_mono = time.monotonic()
    rv = plan.rendezvous(rank)
    form_s = 0.0
    if holder.dp is None or holder.dp.rv != rv:
        if holder.dp is not None:
            holder.dp.close()
            holder.dp = None
        where = getattr(holder, "worker_address", "")  # a cell's; tests pass bare holders
        holder.dp = dp.DPGroup(
            rv,
            backend=backend,
            timeout_s=timeout_s,
            local_host=host_of(where) if where else None,
        )
        form_s = time.monotonic() - t_mono
        if holder.trainer is not None and sharded.is_sharded(holder.trainer):
            holder.trainer = None  # its FSDP mesh belonged to the group just closed
    group = holder.dp
    t_sync = time.monotonic()
    run = (store.url, run_id)
    mine = holder.trainer if getattr(holder, "trainer_run", None) == run else None
    fsdp = cfg.sharding == "fsdp"
    if fsdp:
        trainer, how = _sharded_trainer(store, run_id, plan.version, cfg, group, mine)
    else:
        if mine is not None and sharded.is_sharded(mine):
            mine = None  # a sharded trainer is no replica to keep or broadcast
        trainer, how = dp.sync_state(
            group,
            mine,
            plan.version,
            lambda: restore_trainer(store, run_id, plan.version, cfg),
        )
    holder.trainer, holder.trainer_run = trainer, run
    costs = {"begin_t": t0, "form_s": form_s, "sync_s": time.monotonic() - t_sync}
    t_train = time.monotonic()
    samples = [s for seg in plan.segments for s in load_samples(store, seg)]
    samples.sort(key=lambda s: s.sample_id)  # the same order on every member
    random.Random(plan.shuffle_seed).shuffle(samples)
    if rank == 0:
        _check_ledger(store, run_id, plan.step, samples)
    dropped = 0
    if cfg.stale_policy == "drop":
        kept = []
        for s in samples:
            s2, n = drop_stale(s, plan.version, cfg.max_staleness)
            kept.append(s2)
            dropped += n
        train_on = kept
    else:
        train_on = samples
    sizes = [s.n_tokens for s in train_on]
    long: list[int] = []
    if cfg.context_parallel_tokens and group.world > 1:
        long, parts = dp.shard_with_context_parallel(
            sizes, group.world, cfg.context_parallel_tokens
        )
    else:
        parts = dp.shard(sizes, group.world)
    mine = [train_on[i] for i in parts[rank]]
    together = [train_on[i] for i in long]  # every member holds a slice of each
    normalizer = float(sum(s.n_flat_trainable for s in train_on)) or 1.0
    t_compute = time.monotonic()
    # paced: the step's device time (plan.pace_s, from the member's start: the simulator's
    # step), else per token of this member's shard
    started, device_s = (t_mono, plan.pace_s) if plan.pace_s > 0 else (t_compute, 0.0)
    if not plan.pace_s:
        device_s = s_per_token * (
            sum(s.n_tokens for s in mine) + sum(s.n_tokens for s in together) / group.world
        )
    if fsdp:  # the same split (dp.shard) and normaliser, inside sharded_step
        metrics = sharded.sharded_step(
            trainer,
            train_on,
            rank=rank,
            world=group.world,
            current_version=plan.version,
            before_reduce=lambda: dp.pace(started, device_s),
        )
    else:
        metrics = trainer.step(
            mine,
            current_version=plan.version,
            normalizer=normalizer,
            reduce_grads=_paced(group, started, device_s),
            cp_samples=together,
        )
    metrics["train/context_parallel_samples"] = float(len(together))
    metrics = group.reduce_metrics(metrics)
    rewards = [s.reward for s in samples]
    metrics["train/reward_mean"] = float(np.mean(rewards)) if rewards else 0.0
    metrics["train/dropped_stale_tokens"] = float(dropped)
    metrics["train/dp_sync"] = SYNC_CODES[how]
    costs["train_s"] = time.monotonic() - t_train
    t_commit = time.monotonic()
    staged = stage_sharded(store, run_id, trainer) if fsdp else None
    if rank != 0:
        return TrainedStep(
            step=plan.step,
            weight_version=trainer.version,
            checkpoint="",
            metrics=metrics,
            costs=costs,
        )
    out = commit_step(
        store,
        run_id,
        plan.step,
        trainer,
        plan.version,
        samples,
        metrics,
        members=plan.members,
        t_start=t0,
        generation=plan.generation,
        mode=mode,
        staged=staged,
    )
    costs["commit_s"] = time.monotonic() - t_commit
    return replace(out, costs=costs)


def _paced(group: dp.DPGroup, started: float, device_s: float):
    """The DP gradient reduction, after this member's paced device time has passed."""

    def reduce(model) -> None:
        dp.pace(started, device_s)
        group.reduce_grads(model)

    return reduce


def member_on_cell(
    store: Store, run_id: str, plan: dp.StepPlan, rank: int, cfg: TrainConfig, **kw
) -> TrainedStep:
    """``member_step`` on the training cell running the caller (a Dask task), whose plugin
    keeps the replica and the DP group between steps."""
    return member_step(store, run_id, plan, rank, cfg, holder=this_cell(), **kw)


@task(name="train-member", task_run_name="train-step-{plan.step}-g{plan.generation}-r{rank}")
def train_member(
    store: Store,
    run_id: str,
    plan: dp.StepPlan,
    rank: int,
    cfg: TrainConfig,
    s_per_token: float = 0.0,
    timeout_s: float = 600.0,
    backend: str = "auto",
    mode: str = "",
) -> TrainedStep:
    """This training cell's part of one data-parallel step (rank 0 publishes the version)."""
    cell = this_cell()
    out = member_on_cell(
        store,
        run_id,
        plan,
        rank,
        cfg,
        s_per_token=s_per_token,
        timeout_s=timeout_s,
        backend=backend,
        mode=mode,
    )
    if rank == 0:
        get_run_logger().info(
            "step %d -> v%d on %d member(s) (%s): loss %.4f, %d tokens, lag mean %.2f max %d",
            plan.step,
            out.weight_version,
            len(plan.members),
            cell_name(cell.worker_address),
            out.metrics["train/loss"],
            out.metrics["train/tokens"],
            out.metrics["train/lag_mean"],
            out.metrics["train/lag_max"],
        )
    return out
