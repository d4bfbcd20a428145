"""Held-out evaluation: which tasks, when, and what the numbers mean (the ``eval`` section).

A run is judged on tasks it never trained on, sampled greedily (temperature 0, one attempt
per turn), before the first step and every ``eval.every`` steps, through the same gateway and
rollout cells as training (tasks/evaluate.py runs it, flows/evaluation.py schedules it).

Seeds. Training derives one task seed per rollout group, ``rollout.seed * 1_000_003 +
index * 1009`` (``train_task_seed``); the warm start's demonstrations use ``DEMO_SEED0 + k``
(flows/warmstart.py); evaluation uses ``eval.seed0 + k`` for ``k < eval.tasks``. The bundled
suites draw a task with ``random.Random(seed)``, which seeds CPython's generator with the
*absolute value* of an integer (``Random(-5)`` and ``Random(5)`` give the same task), so
negative seeds are not held out: disjointness is checked on absolute values
(``seed_overlap``), once, when the config is validated.

A suite with few distinct tasks (``repo`` has 15 specs) repeats tasks under new seeds: there
the held-out set is held out by seed, not by content, and measures the loop rather than
generalisation.

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

TRAIN_SEED_STRIDE = 1_000_003  # per rollout.seed
TRAIN_INDEX_STRIDE = 1009  # per rollout group (start order)
EVAL_SEED0 = 7_000_000_000_000


class EvalConfig(BaseModel):
    """The ``eval`` section: held-out tasks, evaluated greedily as the run goes."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    every: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="evaluate before the first step, every N steps and after the last; "
        "0 = no evaluation",
    )
    tasks: int = Field(16, ge=1, le=100_000, description="held-out tasks (one session each)")
    seed0: int = Field(EVAL_SEED0, description="held-out task seeds are seed0 .. seed0 + tasks - 1")
    max_attempts: int = Field(
        1, ge=1, le=16, description="tries per turn (greedy: a retry repeats itself)"
    )
    concurrency: int = Field(8, ge=1, le=1024, description="evaluation sessions at once")
    timeout_s: float = Field(300.0, ge=1.0, le=7 * 24 * 3600.0, description="per session")


def train_task_seed(rollout_seed: int, index: int) -> int:
    """The task seed of rollout group ``index`` (flows/schedule.py derives it so)."""
    return rollout_seed * TRAIN_SEED_STRIDE + index * TRAIN_INDEX_STRIDE


def eval_seeds(cfg: EvalConfig) -> list[int]:
    return [cfg.seed0 + k for k in range(cfg.tasks)]


def eval_versions(steps: int, every: int) -> list[int]:
    """The policy versions evaluated: 0 (before the first step), every ``every`` steps, and
    the last one (``steps``)."""
    if every <= 0:
        return []
    return sorted({*range(0, steps + 1, every), steps})


def seed_overlap(
    seeds: Iterable[int], rollout_seed: int, max_groups: int, ranges: Sequence[range] = ()
) -> list[int]:
    """The seeds (by absolute value, see the module docstring) that training groups
    ``0 .. max_groups - 1`` would draw, or that fall in one of ``ranges`` (demonstrations)."""
    hit = []
    for s in seeds:
        a = abs(s)
        for target in {a, -a}:
            off = target - rollout_seed * TRAIN_SEED_STRIDE
            if off % TRAIN_INDEX_STRIDE == 0 and 0 <= off // TRAIN_INDEX_STRIDE < max_groups:
                hit.append(s)
                break
        else:
            if any(a in r or -a in r for r in ranges):
                hit.append(s)
    return hit


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error (sample std / sqrt(n); 0 for fewer than 2 values)."""
    n = len(values)
    if n == 0:
        return 0.0, 0.0
    m = sum(values) / n
    if n < 2:
        return m, 0.0
    var = sum((v - m) ** 2 for v in values) / (n - 1)
    return m, math.sqrt(var / n)
