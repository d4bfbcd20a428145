"""Settings of the scheduler (the `scheduler` section of a run config) and the policy they build.

One section drives every mode, so that a comparison changes ``mode`` and nothing else:

- ``mode``: ``colocate`` (all cells roll out a batch, then all train on it), ``async`` (a
  fixed split, batch ``b`` trained by step ``b``, rollouts at most ``train.max_staleness``
  versions ahead), ``async-stream`` (the same split with streaming, lag-bounded steps: the
  strongest fixed-split baseline) or ``elastic`` (streaming lag-bounded steps, waterlevel
  control, boundary dispatch, core retention, dynamic-membership DP).
- one lag bound for every mode: ``train.max_staleness`` (policies schedule for it, the
  trainer enforces it).
- the unit the scheduler counts is one *group*: ``rollout.group_size`` sessions of one task,
  which GRPO needs together; a step trains ``rollout.groups_per_step`` groups.
- ``pacing``: device time of the cells, for benchmarks where a few CPU cores stand in for
  more accelerators (see :class:`PacingConfig`); off by default.

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Mode = Literal["colocate", "async", "async-stream", "elastic"]


class PacingConfig(BaseModel):
    """Paced device and environment time, so few CPU cores stand in for many devices.

    A rollout cell's decode step takes ``decode_step_s`` for any batch up to the engine's
    ``max_batch_size`` (a GPU decodes a batch in about the time of one row), so one cell
    serves at most ``max_batch_size / decode_step_s`` tokens/s and one session
    ``1 / decode_step_s``; prefill runs at ``prefill_tokens_per_s``. A training member spends
    ``train_s_per_token`` per token it forwards (its shard of the step). 0 = not paced: the
    real compute is all there is.

    The world the agents act in: every environment step takes a log-normal time around
    ``env_step_s`` (spread ``env_step_sigma``: a long tail of slow tools), and a group's
    rollout length (sub-tasks) is ``rollout.subtasks`` scaled by a log-normal draw
    (``length_sigma``) and by a factor growing linearly from 1 to ``length_growth`` over the
    run (agents learn longer horizons as they train).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    decode_step_s: float = Field(
        0.0, ge=0, le=10, description="floor on an engine's decode step, seconds (0 = unpaced)"
    )
    prefill_tokens_per_s: float = Field(
        0.0, ge=0, description="ceiling on prefill speed, tokens/s (0 = unpaced)"
    )
    train_s_per_token: float = Field(
        0.0, ge=0, le=10, description="floor on a trainer's time per token, seconds (0 = unpaced)"
    )
    env_step_s: float = Field(
        0.0, ge=0, le=600, description="median seconds of one environment step (tool, test)"
    )
    env_step_sigma: float = Field(0.0, ge=0, le=3, description="log-normal tail of env steps")
    length_sigma: float = Field(
        0.0, ge=0, le=3, description="log-normal spread of sub-tasks per group (rollout length)"
    )
    length_growth: float = Field(
        1.0, gt=0, le=16, description="rollout length at the run's end / at its start"
    )
    workload: str = Field(
        "",
        description="a workload file (tasks/sched/workload.py): when set, group i holds its "
        "slot for the file's drawn duration of rollout i, steps, weight loads and role "
        "changes take the file's times, all scaled by time_scale (see paced_workload)",
    )
    time_scale: float = Field(
        1.0 / 60.0,
        gt=0,
        le=1,
        description="live seconds per workload second (1/60: a minute"
        " of the workload is a second live)",
    )


class SchedulerConfig(BaseModel):
    """How cells are given roles while a run goes on (DESIGN.md §6)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    mode: Mode = Field(
        "elastic",
        description="colocate | async | async-stream | elastic; async modes split cells as "
        "cluster.rollout_cells + cluster.train_cells",
    )
    groups_per_cell: int = Field(
        2, ge=1, le=64, description="groups a rollout cell serves at once (its session cap)"
    )
    core: int = Field(1, ge=1, description="rollout cells elastic never takes (core retention)")
    low_mark: float = Field(
        3.0,
        ge=0,
        description="elastic staffs training when the next step is due within this (seconds): "
        "about what a cell needs to join (a call boundary, the switch, a tick)",
    )
    high_mark: float = Field(
        8.0,
        gt=0,
        description="elastic lends an idle train cell to rollout when the next step is at "
        "least this far (seconds): low_mark plus a round trip (switch, weight load, call)",
    )
    min_dwell_s: float = Field(5.0, ge=0, description="a cell keeps a role at least this long")
    shuffle_buffer: int = Field(
        0, ge=0, le=1024, description="finished groups held back and released in random order"
    )
    tick_s: float = Field(0.2, gt=0, le=60, description="how often the coordinator decides")
    drain_timeout_s: float = Field(
        60.0, gt=0, description="a withdrawn cell's in-flight calls finish within this, else move"
    )
    step_timeout_s: float = Field(
        600.0, gt=0, description="bound on one training step (DP rendezvous and collectives)"
    )
    dp_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend: auto = nccl on GPUs, gloo on CPU"
    )
    train_s_per_group: float = Field(
        1.0, gt=0, description="the policy's estimate of one member's step time per group"
    )
    dp_sync_s: float = Field(0.1, ge=0, description="the policy's estimate of DP cost per member")
    pacing: PacingConfig = PacingConfig()
    seed: int = Field(
        0, description="seed of the scheduler's draws (shuffle buffer, simulated workload)"
    )

    @model_validator(mode="after")
    def _check(self) -> SchedulerConfig:
        if self.low_mark >= self.high_mark:
            raise ValueError(
                f"scheduler.low_mark={self.low_mark} must be below scheduler.high_mark="
                f"{self.high_mark} (the gap is the dead band: one round trip of a cell)"
            )
        return self


def cell_problems(cfg: SchedulerConfig, rollout_cells: int, train_cells: int) -> list[str]:
    """What is wrong with this many cells for ``cfg.mode`` (each names the setting and fix)."""
    n = rollout_cells + train_cells
    if cfg.mode == "elastic" and not cfg.core < n:
        return [
            f"scheduler.core={cfg.core}: elastic needs fewer core cells than cells ({n}); "
            "lower scheduler.core or add cells"
        ]
    return []


def build_policy(
    cfg: SchedulerConfig,
    *,
    n_cells: int,
    rollout_cells: int,
    batch: int,
    max_lag: int,
    timeout_s: float,
):
    """The policy object of ``cfg.mode`` — the same classes the simulator drives.

    ``max_lag`` is the run's one lag bound (``train.max_staleness``); ``timeout_s`` the
    rollout cap (``rollout.timeout_s``), which bounds how long a step may wait for the
    oldest rollout.
    """
    from tasks.sched.modes import Async, AsyncStream, Colocate, Elastic
    from tasks.sched.waterlevel import Marks

    cost = {"train_s_per_sample": cfg.train_s_per_group, "dp_sync_s": cfg.dp_sync_s}
    if cfg.mode == "colocate":
        return Colocate(batch=batch, **cost)
    if cfg.mode in ("async", "async-stream"):
        cls = Async if cfg.mode == "async" else AsyncStream
        return cls(batch=batch, rollout_cells=rollout_cells, max_lag=max_lag, **cost)
    return Elastic(
        batch=batch,
        core=min(cfg.core, n_cells - 1),
        timeout_s=timeout_s,
        marks=Marks(low=cfg.low_mark, high=cfg.high_mark),
        max_lag=max_lag,
        min_dwell_s=cfg.min_dwell_s,
        **cost,
    )


def paced_workload(
    pacing: PacingConfig, *, cells: int, cap: int, batch: int, steps: int, tick_s: float
):
    """The workload a paced live run plays, in live seconds; None when not paced by a file.

    The file's sizes give way to the run's (``cells``; ``cap`` = groups per rollout cell;
    ``batch`` = groups per step; ``steps``): one live group is one simulated rollout. Every
    time (fields ending in ``_s``, costs ``*_s_per_*``, ``max_hours``) is multiplied by
    ``time_scale``, and the tick is the run's ``tick_s``; so ``simulate`` on this workload
    predicts the live run in live seconds, rollout ``i`` lasting ``Durations(w, seed)[i]``
    on both sides.
    """
    if not pacing.workload:
        return None
    import dataclasses

    from tasks.sched.workload import load_workload

    w = load_workload(pacing.workload)
    k = pacing.time_scale
    scaled = {
        f.name: getattr(w, f.name) * k
        for f in dataclasses.fields(w)
        if f.name.endswith("_s") or "_s_per_" in f.name or f.name == "max_hours"
    }
    scaled["tick_s"] = tick_s
    return dataclasses.replace(w, cells=cells, cap=cap, batch=batch, steps=steps, **scaled)


def coordinator_args(pacing: PacingConfig) -> dict[str, float]:
    """The Coordinator's own time constants for a run paced by a workload file, scaled as
    the file is (its finish-rate smoothing), so the live coordinator and the simulated one
    on the paced workload see the file's run at the same speed; ``{}`` when not paced."""
    if not pacing.workload:
        return {}
    from tasks.sched.coordinator import Coordinator

    return {"rate_tau_s": Coordinator.rate_tau_s * pacing.time_scale}


def group_shape(
    pacing: PacingConfig, subtasks: int, index: int, total: int, seed: int
) -> tuple[int, float, float]:
    """Sub-tasks, env step median and spread of rollout group ``index`` of ~``total``.

    Deterministic in (seed, index): every mode of a comparison gets the same workload.
    The draw is capped at four times ``subtasks`` (never below 32), so a long-horizon
    suite's 200 sub-tasks stay 200 when nothing scales them.
    """
    import random

    rng = random.Random(seed * 1_000_003 + index)
    progress = min(1.0, index / max(1, total - 1))
    scale = (1.0 + (pacing.length_growth - 1.0) * progress) * math.exp(
        pacing.length_sigma * rng.gauss(0.0, 1.0)
    )
    n = max(1, min(max(32, 4 * subtasks), round(subtasks * scale)))
    return n, pacing.env_step_s, pacing.env_step_sigma
