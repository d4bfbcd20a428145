"""Settings of rollouts: the task suite, the harness and sampling (the `rollout` section).

``suite`` and ``harness`` follow the contract in tasks/env/suite.py; they are imported and
tried (one task, one environment) when the config is validated, so a typo fails before
anything starts, with every problem listed.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from tasks.env.suite import BUILTIN_SUITES, check_harness, check_suite


class RolloutConfig(BaseModel):
    """What each step rolls out and how the harness samples."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    difficulty: int = Field(1, ge=0, le=10, description="the suite's difficulty level")
    groups_per_step: int = Field(1, ge=1, le=4096, description="tasks per step (GRPO groups)")
    group_size: int = Field(4, ge=1, le=1024, description="sessions per task")
    subtasks: int = Field(
        3, ge=1, le=1024, description="sub-tasks per task (suites that vary it; logbook: pages)"
    )
    max_attempts: int = Field(2, ge=1, description="tries per turn (retries become branches)")
    max_tool_rounds: int = Field(
        0, ge=0, le=1000, description="tool rounds per turn (0 = the suite's own)"
    )
    summarize_every: int = Field(
        0, ge=0, description="harness resets its context every N turns (0 = never)"
    )
    context_tokens: int = Field(
        0, ge=0, description="compact the context when a call's tokens pass this (0 = never)"
    )
    context_policy: Literal["summarize", "truncate"] = Field(
        "summarize",
        description="how the harness compacts a context past context_tokens: summarize the "
        "old turns, or truncate them",
    )
    isolation: Literal["auto", "namespaces", "rlimits"] = Field(
        "auto", description="sandbox for agent code (tasks/env/sandbox.py)"
    )
    max_new_tokens: int = Field(
        16, ge=1, le=4096, description="tokens the policy may generate per call"
    )
    temperature: float = Field(
        1.0, ge=0.0, le=10.0, description="sampling temperature of rollouts (0 = greedy)"
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling of rollouts")
    timeout_s: float = Field(
        600.0, ge=1.0, le=7 * 24 * 3600.0, description="a session's wall-clock limit"
    )
    max_failed_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="stop the run, naming the first failures' reasons, when more than this "
        "fraction of a step's sessions fail (a broken agent or harness: training on nothing "
        "is no success); 1 = never stop for failures",
    )
    seed: int = Field(0, description="seed of the training tasks drawn (and sampling)")
    # last: their checks use the options above (pydantic validates fields in order)
    suite: str = Field(
        "arith",
        description=f"task suite: {' | '.join(BUILTIN_SUITES)}, or a dotted path "
        "'package.module:Suite'",
    )
    harness: str = Field(
        "builtin",
        description="agent: builtin (openai client), 'package.module:callable' or 'cmd:COMMAND'",
    )

    def suite_options(self) -> dict[str, object]:
        """The keyword options a suite's constructor may take (tasks/env/suite.py)."""
        return {
            "difficulty": self.difficulty,
            "subtasks": self.subtasks,
            "isolation": self.isolation,
        }

    @field_validator("suite")
    @classmethod
    def _check_suite(cls, v: str, info: ValidationInfo) -> str:
        defaults = {k: cls.model_fields[k].default for k in ("difficulty", "subtasks", "isolation")}
        options = {k: info.data.get(k, d) for k, d in defaults.items()}
        problems = check_suite(v, options, key="")
        if problems:
            raise ValueError("; ".join(problems))
        return v

    @field_validator("harness")
    @classmethod
    def _check_harness(cls, v: str) -> str:
        problems = check_harness(v, key="")
        if problems:
            raise ValueError("; ".join(problems))
        return v
