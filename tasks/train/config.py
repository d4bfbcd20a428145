"""Settings of processing and training (the `train` section of a run config)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TrainConfig(BaseModel):
    """Advantages, staleness and the optimizer step."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    steps: int = Field(2, ge=1, le=10_000_000, description="optimizer steps of the run")
    lr: float = Field(1e-3, gt=0, le=1.0)
    loss: Literal["ppo_clip", "grpo"] = "ppo_clip"
    advantage: Literal["grpo", "per_subtask"] = "grpo"
    clip_eps_low: float = Field(0.2, ge=0, le=1)
    clip_eps_high: float = Field(0.28, ge=0, le=10)
    max_tokens_per_micro: int = Field(4096, ge=64)
    max_staleness: int = Field(1, ge=0, description="policy versions a token may lag")
    stale_policy: Literal["drop", "is"] = "drop"
    is_cap: float = Field(2.0, gt=0)
    reward_aggregation: Literal["weighted_mean", "sum", "min", "all_or_nothing"] = "weighted_mean"
    seed: int = 0
