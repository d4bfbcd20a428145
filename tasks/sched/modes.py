"""The three scheduling modes (DESIGN.md §6), same verbs, no base class.

Each is a small frozen dataclass with ``initial_roles(n)`` and a pure
``recommendations(state) -> list[Decision]`` (see ``tasks/sched_policy.py``).

- :class:`Colocate`: all cells roll out one batch, then all train on it; repeat.
- :class:`Async`: a fixed split (``rollout_cells`` roll out, the rest train);
  rollouts of batch ``b`` start only with weights ``>= b - 1`` and step ``b``
  trains exactly batch ``b``, so staleness is <= 1.
- :class:`Elastic`: streaming training plus waterlevel control with hysteresis,
  boundary dispatch, core retention and dynamic-membership DP.

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tasks.sched.coordinator import (
    CellView,
    Decision,
    LoadWeights,
    Move,
    Role,
    SchedState,
    StartRollouts,
    StartStep,
)
from tasks.sched.waterlevel import Marks, best_members, members_to_keep_up, waterlevel_signal


def _fill(cells: list[CellView], cap: int, budget: int) -> list[Decision]:
    """StartRollouts on free slots, in cell order, at most ``budget`` sessions."""
    out: list[Decision] = []
    for c in cells:
        if budget <= 0:
            break
        free = cap - c.sessions
        if free > 0:
            n = min(free, budget)
            out.append(StartRollouts(c.id, n))
            budget -= n
    return out


@dataclass(frozen=True)
class Colocate:
    """Rollout and training take turns on all cells (the colocate baseline)."""

    batch: int
    name: str = "colocate"

    def initial_roles(self, n_cells: int) -> tuple[Role, ...]:
        return ("rollout",) * n_cells

    def recommendations(self, s: SchedState) -> list[Decision]:
        if any(c.role in ("draining", "loading") for c in s.cells) or s.step_running:
            return []
        batch_done = s.finished_prefix >= s.trained + self.batch and s.in_flight == 0
        if batch_done:
            roll = [c for c in s.cells if c.role == "rollout"]
            if roll:  # the last rollout of the batch ended: everybody to training
                return [Move(c.id, "train") for c in roll]
            return [StartStep(tuple(c.id for c in s.cells), self.batch, order="index")]
        if s.in_flight == 0 and s.started == s.trained:
            train = [c for c in s.cells if c.role == "train"]
            if train:  # the step is done: everybody back to rollout with the new weights
                return [Move(c.id, "rollout") for c in train]
        queued = s.trained + self.batch - s.started
        return _fill([c for c in s.cells if c.role == "rollout"], s.cap, queued)


@dataclass(frozen=True)
class Async:
    """Fixed split, one-step-off-policy pipeline (staleness <= 1)."""

    batch: int
    rollout_cells: int
    name: str = "async"

    def initial_roles(self, n_cells: int) -> tuple[Role, ...]:
        if not 1 <= self.rollout_cells < n_cells:
            raise ValueError(
                f"async needs 1 <= rollout_cells < n_cells, got {self.rollout_cells} of {n_cells}"
            )
        return ("rollout",) * self.rollout_cells + ("train",) * (n_cells - self.rollout_cells)

    def recommendations(self, s: SchedState) -> list[Decision]:
        out: list[Decision] = []
        train = [c for c in s.cells if c.role == "train"]
        if (
            not s.step_running
            and s.finished_prefix >= s.trained + self.batch
            and all(not c.busy for c in train)
        ):
            out.append(StartStep(tuple(c.id for c in train), self.batch, order="index"))
        ready: list[CellView] = []
        for c in s.cells:
            if c.role != "rollout" or c.busy:
                continue
            if c.weight_version < s.version:
                out.append(LoadWeights(c.id, s.version))
            else:
                ready.append(c)
        # rollout number i belongs to batch i // batch and may start only with
        # weights >= batch - 1; ready cells hold s.version, so batches up to
        # s.version + 1 may start: at most one version ahead.
        allowed = (s.version + 2) * self.batch - s.started
        return out + _fill(ready, s.cap, allowed)


@dataclass(frozen=True)
class Elastic:
    """Waterlevel-controlled elastic roles with streaming training.

    - streaming training: a step starts whenever ``batch`` samples are buffered,
      over the idle train cells (at most :func:`best_members` of them).
    - waterlevel control: level (after the step just started) ``>= high`` moves
      up to ``move_step`` rollout cells to training, ``< low`` with training idle
      moves idle train cells back; in between nothing moves (hysteresis), and a
      new batch of moves waits for the previous one to land and for each cell's
      ``min_dwell_s`` in its role.
    - backpressure: while the level is at or above ``high`` no new rollouts
      start, which frees slots for the sessions of cells that leave.
    - boundary dispatch: a rollout cell leaves only if its sessions fit in free
      slots of the core (they are rerouted at their next call boundary); a
      train cell leaves only when not in a step.
    - core retention: cells ``0 .. core-1`` always roll out; they refresh weights
      lazily (``refresh_lag`` versions behind), while cells joining rollout get
      the newest weights as part of the move.
    """

    batch: int
    marks: Marks
    core: int
    train_s_per_sample: float
    dp_sync_s: float
    move_step: int = 1
    min_train: int = 1
    min_dwell_s: float = 300.0
    refresh_lag: int = 2
    name: str = "elastic"

    def initial_roles(self, n_cells: int) -> tuple[Role, ...]:
        if not 1 <= self.core < n_cells:
            raise ValueError(f"elastic needs 1 <= core < n_cells, got {self.core} of {n_cells}")
        n_train = max(self.min_train, 1)
        return ("rollout",) * (n_cells - n_train) + ("train",) * n_train

    def recommendations(self, s: SchedState) -> list[Decision]:
        out: list[Decision] = []
        level = s.water_level
        stepping = s.step_running
        idle_train = [c for c in s.cells if c.role == "train" and not c.busy]
        n_train = sum(1 for c in s.cells if c.role == "train" or c.target == "train")
        t, sync = self.train_s_per_sample, self.dp_sync_s
        m_best = best_members(self.batch, t, sync, len(s.cells) - self.core)
        want = max(
            self.min_train,
            members_to_keep_up(self.batch, t, sync, s.finish_rate, len(s.cells) - self.core),
        )
        # a step's members are fixed at its start: wait until enough cells have
        # joined to keep up with the rollouts (a 1-member step on a 1,000-cell
        # batch would hold training for days) -- unless no more can ever join
        can_grow = (
            self.move_step > 0
            and n_train < m_best
            and any(c.role == "rollout" for c in s.cells[self.core :])
        )
        enough = len(idle_train) >= want or not can_grow
        if not stepping and level >= self.batch and idle_train and enough:
            members = tuple(c.id for c in idle_train[:m_best])
            out.append(StartStep(members, self.batch, order="finish"))
            level -= self.batch
            stepping = True
            idle_train = idle_train[len(members) :]

        sig = waterlevel_signal(level, self.marks)
        moving = any(c.role in ("draining", "loading") for c in s.cells)
        leaving: set[int] = set()
        # grow: above the high mark, or a step is due and training is too small
        # to keep up; shrink: below the low mark, training idle and oversized.
        grow = sig > 0 or (level >= self.batch and n_train < want)
        if not moving and grow and n_train < m_best:
            n_go = min(self.move_step, m_best - n_train)
            free = {
                c.id: s.cap - c.sessions
                for c in s.cells[: self.core]
                if c.role == "rollout" and not c.busy and c.sessions < s.cap
            }
            cands = sorted(
                (
                    c
                    for c in s.cells[self.core :]
                    if c.role == "rollout" and not c.busy and s.now - c.since >= self.min_dwell_s
                ),
                key=lambda c: (c.sessions, c.id),
            )
            for c in cands:
                if len(leaving) >= n_go or c.sessions > sum(free.values()):
                    break  # sorted by sessions: no later candidate fits either
                reroute, need = [], c.sessions
                for tgt in list(free):
                    if need == 0:
                        break
                    k = min(need, free[tgt])
                    reroute.append((tgt, k))
                    need -= k
                    free[tgt] -= k
                    if free[tgt] == 0:
                        del free[tgt]
                out.append(Move(c.id, "train", reroute=tuple(reroute)))
                leaving.add(c.id)
        elif not moving and sig < 0 and not stepping and n_train > want:
            spare = [c for c in idle_train if s.now - c.since >= self.min_dwell_s]
            n_go = min(self.move_step, len(spare), n_train - want)
            for c in spare[: max(0, n_go)]:
                out.append(Move(c.id, "rollout"))

        ready: list[CellView] = []
        for c in s.cells:
            if c.role != "rollout" or c.busy or c.id in leaving:
                continue
            if s.version - c.weight_version >= self.refresh_lag:
                out.append(LoadWeights(c.id, s.version))
            else:
                ready.append(c)
        if level < self.marks.high and not grow:
            out += _fill(ready, s.cap, len(ready) * s.cap)
        return out


def core_cells(n_cells: int, frac: float) -> int:
    """Core size for a pool: ``ceil(frac * n)``, at least 1 and at most n - 1."""
    return max(1, min(n_cells - 1, math.ceil(frac * n_cells)))
