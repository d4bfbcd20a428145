"""Partial scoring: sub-task scores -> a rollout's reward.

A long rollout is judged on sub-tasks (for a repository task: groups of tests).
Each finished sub-task reports a score in [0, 1] with a weight and the call after
which it was earned (``at_request_id``); in the trajectory tree it attaches to the
end of that call's output. The rollout's reward is a declared aggregation of the
sub-task scores. Failed, timed-out and unfinished rollouts are scored on what they
finished: every declared sub-task that was never reached counts 0 with a
recorded reason, so no rollout is silently dropped.

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

Aggregation = Literal["weighted_mean", "sum", "min", "all_or_nothing"]
AGGREGATIONS: tuple[str, ...] = ("weighted_mean", "sum", "min", "all_or_nothing")
STATUSES: tuple[str, ...] = ("finished", "failed", "timeout", "unfinished")


class ScoreError(ValueError):
    """A score row is invalid (score outside [0, 1], negative weight, unknown status)."""


@dataclass(frozen=True, slots=True)
class Score:
    """One sub-task score (storage/schemas.py: SCORES_SCHEMA)."""

    run_id: str
    session_id: str
    subtask_id: str
    score: float
    weight: float = 1.0
    at_request_id: str | None = None  # None: not tied to a call (e.g. never reached)
    source: str = "harness"  # harness | env | evaluator | scoring (filled-in zeros)
    status: str = "finished"  # finished | failed | timeout | unfinished
    reason: str = ""

    def __post_init__(self) -> None:
        errors = []
        if not (0.0 <= self.score <= 1.0) or math.isnan(self.score):
            errors.append(f"score={self.score} (must be in [0, 1]; clamp or rescale at the source)")
        if not (self.weight >= 0.0) or math.isinf(self.weight):
            errors.append(f"weight={self.weight} (must be finite and >= 0)")
        if self.status not in STATUSES:
            errors.append(f"status={self.status!r} (one of {', '.join(STATUSES)})")
        if errors:
            raise ScoreError(
                f"sub-task {self.subtask_id!r} of session {self.session_id!r}: " + "; ".join(errors)
            )

    def to_row(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Score:
        names = cls.__dataclass_fields__.keys()
        kw = {k: row[k] for k in names if k in row and row[k] is not None}
        if "at_request_id" in row:
            kw["at_request_id"] = row["at_request_id"]
        return cls(**kw)


@dataclass(frozen=True)
class RolloutScore:
    """A rollout's reward and the complete list of sub-task scores behind it."""

    reward: float
    scores: list[Score]  # reported scores (latest per sub-task) + zeros for unreached ones
    missing: list[str]  # declared sub-tasks that were never reported
    status: str  # the rollout's status


def aggregate(scores: Sequence[Score], how: str = "weighted_mean") -> float:
    """Combine sub-task scores into one reward in [0, 1] (``sum``: in [0, sum of weights]).

    - ``weighted_mean``: sum(w * s) / sum(w); 0 when no weight.
    - ``sum``: sum(w * s).
    - ``min``: the smallest score; 0 when there are none.
    - ``all_or_nothing``: 1 if every sub-task scored 1, else 0 (0 when there are none).
    """
    if how == "weighted_mean":
        tw = sum(s.weight for s in scores)
        return sum(s.weight * s.score for s in scores) / tw if tw > 0 else 0.0
    if how == "sum":
        return float(sum(s.weight * s.score for s in scores))
    if how == "min":
        return min((s.score for s in scores), default=0.0)
    if how == "all_or_nothing":
        return 1.0 if scores and all(s.score >= 1.0 for s in scores) else 0.0
    raise ScoreError(f"aggregation={how!r} is unknown; use one of {', '.join(AGGREGATIONS)}")


def score_rollout(
    run_id: str,
    session_id: str,
    scores: Iterable[Score],
    *,
    declared: Mapping[str, float] | Sequence[str] | None = None,
    status: str = "finished",
    reason: str = "",
    aggregation: str = "weighted_mean",
) -> RolloutScore:
    """Reward of one rollout on what it finished.

    ``declared`` names the rollout's sub-tasks (optionally with weights); a declared
    sub-task with no reported score gets score 0, ``source='scoring'``, the
    rollout's ``status`` and a reason ("not reached: <reason>"). A sub-task reported
    more than once keeps its latest report. Scores of other sessions are ignored.
    """
    if status not in STATUSES:
        raise ScoreError(f"status={status!r} is unknown; use one of {', '.join(STATUSES)}")
    if aggregation not in AGGREGATIONS:
        raise ScoreError(
            f"aggregation={aggregation!r} is unknown; use one of {', '.join(AGGREGATIONS)}"
        )
    latest: dict[str, Score] = {}
    for s in scores:
        if s.session_id == session_id:
            latest[s.subtask_id] = s
    weights: dict[str, float] = {}
    if declared is not None:
        weights = dict(declared) if isinstance(declared, Mapping) else {d: 1.0 for d in declared}
    missing = [d for d in weights if d not in latest]
    why = reason or status
    filled = list(latest.values()) + [
        Score(
            run_id,
            session_id,
            d,
            0.0,
            weights[d],
            None,
            "scoring",
            "unfinished" if status == "finished" else status,
            f"not reached: {why}",
        )
        for d in missing
    ]
    return RolloutScore(aggregate(filled, aggregation), filled, missing, status)


def scores_at_requests(scores: Iterable[Score]) -> dict[str, float]:
    """Sum of sub-task scores per call they were earned at (for tree node rows)."""
    out: dict[str, float] = {}
    for s in scores:
        if s.at_request_id is not None:
            out[s.at_request_id] = out.get(s.at_request_id, 0.0) + s.score
    return out
