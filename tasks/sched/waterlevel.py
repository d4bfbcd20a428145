"""Waterlevel control and the dynamic-membership DP step-time model.

The *water level* is the number of trainable samples buffered and not yet
trained (DESIGN.md §2). The elastic scheduler keeps it between a low and a high
mark: above the high mark training is the bottleneck (cells should move to
training), below the low mark training starves (cells should go back to
rollout). The band between the marks is the hysteresis: inside it nothing
moves, so a level wobbling around one mark never flips roles back and forth.

Under a lag bound the level that matters is not a sample count but *how soon
the next step can start* (the water must hold a batch and the lag gate must
open, see ``tasks/sched/lag.py``): :func:`due_signal` reads that time against
two marks in seconds -- soon enough to staff training, or far enough off to
lend its idle cells to rollout -- with the same dead band between them.

Also here: how long one data-parallel step takes with ``m`` members, the model
the elastic policy uses to decide how many training cells are worth having.
Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Signal = Literal[-1, 0, 1]


@dataclass(frozen=True)
class Marks:
    """Low/high water marks in samples; ``high - low`` is the hysteresis band."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(
                f"water marks need 0 <= low < high, got low={self.low} high={self.high}: "
                "raise high or lower low (the gap is the hysteresis band)"
            )


def waterlevel_signal(level: float, marks: Marks) -> Signal:
    """+1: move cells to training; -1: move cells back to rollout; 0: hold.

    ``level >= high`` -> +1, ``level < low`` -> -1, otherwise 0 (dead band).
    """
    if level >= marks.high:
        return 1
    if level < marks.low:
        return -1
    return 0


def due_signal(eta_s: float, marks: Marks) -> Signal:
    """+1: staff training now; -1: training's idle cells may roll out; 0: hold.

    ``eta_s`` is the time until the next step can start; ``eta_s <= low`` ->
    +1 (cells need ``low`` seconds to join), ``eta_s >= high`` -> -1 (worth a
    round trip), otherwise 0 (dead band).
    """
    if eta_s <= marks.low:
        return 1
    if eta_s >= marks.high:
        return -1
    return 0


def dp_step_seconds(samples: int, members: int, s_per_sample: float, sync_s: float) -> float:
    """Wall time of one data-parallel optimizer step over ``members`` cells.

    The batch is split evenly (compute ~ samples / members) and every member
    adds a fixed synchronisation cost (gradient combine, membership change), so
    beyond some size more members make a step slower, not faster.
    """
    if members < 1:
        raise ValueError(f"a training step needs at least one member, got {members}")
    return samples * s_per_sample / members + sync_s * members


def best_members(samples: int, s_per_sample: float, sync_s: float, limit: int) -> int:
    """Member count in ``[1, limit]`` minimising :func:`dp_step_seconds`.

    The continuous optimum is sqrt(samples * s_per_sample / sync_s); the best
    integer is one of its two neighbours.
    """
    if limit < 1:
        return 0
    if sync_s <= 0:
        return limit
    x = math.sqrt(samples * s_per_sample / sync_s)
    cands = {max(1, min(limit, math.floor(x))), max(1, min(limit, math.ceil(x)))}
    return min(cands, key=lambda m: (dp_step_seconds(samples, m, s_per_sample, sync_s), m))


def members_to_keep_up(
    samples: int,
    s_per_sample: float,
    sync_s: float,
    rate: float,
    limit: int,
    headroom: float = 1.25,
) -> int:
    """Fewest DP members whose step on ``samples`` finishes before the rollouts
    (at ``rate`` samples/s) produce the next ``samples`` — with ``headroom``.

    Solves ``samples * s / m + sync * m <= samples / (rate * headroom)`` for the
    smallest integer ``m``; if no ``m`` can keep up, the fastest one
    (:func:`best_members`). ``rate <= 0`` (nothing observed yet) gives 1.
    """
    best = best_members(samples, s_per_sample, sync_s, limit)
    if rate <= 0:
        return 1
    budget = samples / (rate * headroom)
    work = samples * s_per_sample
    if sync_s <= 0:
        return max(1, min(best, math.ceil(work / budget)))
    disc = budget * budget - 4.0 * sync_s * work
    if disc < 0:
        return best
    m = math.ceil((budget - math.sqrt(disc)) / (2.0 * sync_s) - 1e-9)
    return max(1, min(best, m))
