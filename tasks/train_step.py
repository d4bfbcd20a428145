"""Prefect task: one optimizer step on a training cell, then publish the new version.

The trainer replica (model + optimizer) stays in the cell's process between
steps; a cell that has none yet (first step, or a cell that just joined the
training role) restores it from the newest checkpoint in the store, optimizer
state included. The ledger records which samples each step consumed, and a
step whose samples are already in the ledger is refused, so a retried or
replayed step never trains a sample twice.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import pyarrow.parquet as pq
from prefect import task
from prefect.logging import get_run_logger

from infra.cells.cluster import cell_name, this_cell
from storage.checkpoints import fetch_checkpoint, latest_version, publish_checkpoint
from storage.store import Store
from tasks.handles import TrainedStep
from tasks.train.config import TrainConfig
from tasks.train.trainer import Trainer
from tasks.trajectory.sampler import Sample


class LedgerError(RuntimeError):
    """Samples handed to a step were already consumed by an earlier step."""


def load_samples(store: Store, segment: str) -> list[Sample]:
    with store.fs.open(segment, "rb") as fh:
        rows = pq.read_table(fh).to_pylist()
    return [Sample.from_row(r) for r in rows]


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
        # "drop": the sampler already removed them
        "max_staleness": cfg.max_staleness if cfg.stale_policy == "is" else None,
    }


def get_trainer(store: Store, run_id: str, cfg: TrainConfig, holder: Any = None) -> Trainer:
    """The cell's trainer replica at the newest version, restored from the store if needed."""
    version = latest_version(store, run_id)
    if version is None:
        raise FileNotFoundError(f"no checkpoint in {store.url}: publish v0 before training")
    key = (store.url, run_id, version)
    if holder is not None and holder.trainer is not None and holder.trainer_key == key:
        return holder.trainer
    path = fetch_checkpoint(store, run_id, version, with_optimizer=True)
    trainer = Trainer.load(path, version=version, **_trainer_kwargs(cfg))
    if holder is not None:
        holder.trainer, holder.trainer_key = trainer, key
    return trainer


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
    """The body of ``train_step`` (callable without Prefect and Dask, e.g. in tests)."""
    t0 = time.time()
    samples = load_samples(store, samples_segment) if samples_segment else []
    ledger = store.read("ledger")
    done = set(ledger["sample_id"].to_pylist()) if ledger.num_rows else set()
    again = [s.sample_id for s in samples if s.sample_id in done]
    if again:
        raise LedgerError(f"step {step}: {len(again)} samples already trained, e.g. {again[0]!r}")
    trainer = get_trainer(store, run_id, cfg, holder)
    metrics = trainer.step(samples)
    version = trainer.version
    with tempfile.TemporaryDirectory(prefix="gyre-ckpt-") as tmp:
        trainer.save(tmp)
        url = publish_checkpoint(store, run_id, tmp, version)
    if holder is not None:
        holder.trainer_key = (store.url, run_id, version)
    t1 = time.time()
    store.append(
        "ledger",
        [
            {
                "run_id": run_id,
                "step": step,
                "sample_id": s.sample_id,
                "weight_version": version,
                "t": t1,
            }
            for s in samples
        ],
    )
    store.append(
        "steps",
        [
            {
                "run_id": run_id,
                "step": step,
                "weight_version": version,
                "loss": metrics["train/loss"],
                "tokens": int(metrics["train/tokens"]),
                "trainable_tokens": int(metrics["train/trainable_tokens"]),
                "reward": metrics["train/reward_mean"],
                "n_samples": len(samples),
                "grad_norm": metrics["train/grad_norm"],
                "mean_staleness": metrics["train/staleness_mean"],
                "cells": [cell_id],
                "t_start": t0,
                "t_end": t1,
                "checkpoint": url,
            }
        ],
    )
    return TrainedStep(step=step, weight_version=version, checkpoint=url, metrics=metrics)


@task(name="train-step", task_run_name="train-step-{step}")
def train_step(
    store: Store, run_id: str, step: int, samples_segment: str | None, cfg: TrainConfig
) -> TrainedStep:
    """One optimizer step on this training cell; returns the new version and metrics."""
    cell = this_cell()
    out = train_on_samples(
        store,
        run_id,
        step,
        samples_segment,
        cfg,
        holder=cell,
        cell_id=cell_name(cell.worker_address),
    )
    get_run_logger().info(
        "step %d -> v%d: loss %.4f, %d tokens (%d trainable), grad norm %.3f",
        step,
        out.weight_version,
        out.metrics["train/loss"],
        out.metrics["train/tokens"],
        out.metrics["train/trainable_tokens"],
        out.metrics["train/grad_norm"],
    )
    return out
