"""Handles passed between the Prefect tasks and the flow: small, frozen, picklable.

A task returns where its output is and what it counts, never the data itself
(STYLE.md habit 2): sessions by id, samples by segment path, weights by version.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GroupSpec:
    """What one rollout group is: the scheduler's rollout number ``index`` (start order),
    its task, how many sub-tasks (rollout length) and how slow its environment is."""

    index: int
    group_id: str
    task_seed: int
    subtasks: int
    step: int = 0  # the step a batch-synchronous mode would train it in (index // batch)
    env_step_s: float = 0.0  # median seconds of one environment step (0 = instant)
    env_step_sigma: float = 0.0  # log-normal spread: the tail of slow steps
    cell_id: str | None = None  # the rollout cell the scheduler placed the group on
    # paced by a workload file (scheduler.pacing.workload): every session of the group holds
    # its slot ``duration_s`` seconds, with a model call every ``call_s`` (0 = not paced)
    duration_s: float = 0.0
    call_s: float = 0.0
    t_start: float = 0.0  # wall clock of the decision that started it (the slot is held since)


@dataclass(frozen=True)
class SessionHandle:
    """One finished (or failed, or timed-out) rollout session."""

    session_id: str
    group_id: str
    task_id: str
    step: int
    status: str  # finished | timeout | failed | unfinished (the run ended first)
    subtasks: dict[str, float] = field(default_factory=dict)  # declared sub-task -> weight
    reason: str = ""
    calls: int = 0
    parent_session_id: str | None = None  # the session a sub-agent session works for


@dataclass(frozen=True)
class ProcessedStep:
    """Trees, scores and samples of one step's sessions, in the store."""

    step: int
    samples_segment: str | None
    sample_ids: tuple[str, ...]
    n_samples: int
    n_calls: int
    n_nodes: int
    tokens_unique: int
    tokens_flat: int
    reward_mean: float
    version_min: int = -1  # oldest policy version among the samples' tokens (-1: none)
    zero_variance_groups: int = 0  # groups with no learning signal (filtered out)


@dataclass(frozen=True)
class TrainedStep:
    """One optimizer step: the version it published and its metrics (``train/...``).

    ``costs``: this member's own measured parts of the step (``member_step``): ``begin_t``
    (wall clock: the member's start), ``form_s`` (its DP group formed: 0 when the
    generation was kept), ``sync_s`` (its state brought to the step's version: kept,
    broadcast or the checkpoint), ``train_s`` (its samples read, forward, backward, the
    reduction, paced device time included), ``commit_s`` (rank 0: the checkpoint staged and
    the step committed).
    """

    step: int
    weight_version: int
    checkpoint: str
    metrics: dict[str, float] = field(default_factory=dict)
    costs: dict[str, float] = field(default_factory=dict)
