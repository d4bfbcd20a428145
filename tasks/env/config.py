"""Settings of rollouts: the environment, the harness and sampling (the `rollout` section)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class RolloutConfig(BaseModel):
    """What each step rolls out and how the harness samples."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    env: Literal["arith"] = "arith"
    groups_per_step: int = Field(1, ge=1, le=4096, description="tasks per step (GRPO groups)")
    group_size: int = Field(4, ge=1, le=1024, description="sessions per task")
    subtasks: int = Field(3, ge=1, le=32)
    max_attempts: int = Field(2, ge=1, description="tries per sub-task (retries become branches)")
    summarize_every: int = Field(
        0, ge=0, description="harness resets its context every N sub-tasks (0 = never)"
    )
    max_new_tokens: int = Field(16, ge=1, le=4096)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    timeout_s: float = Field(
        600.0, ge=1.0, le=7 * 24 * 3600.0, description="a session's wall-clock limit"
    )
    seed: int = 0
