"""The scheduling modes (DESIGN.md §6), same verbs, no base class.

Each is a small frozen dataclass with ``initial_roles(n)`` and a pure
``recommendations(state) -> list[Decision]`` (see ``tasks/sched/coordinator.py``).

- :class:`Colocate`: all cells roll out one batch, then train on it; repeat
  (lag 0).
- :class:`Async`: a fixed split; step ``b`` trains exactly rollouts
  ``b*batch .. (b+1)*batch - 1`` once all have finished; rollouts start at most
  ``max_lag`` versions ahead (the one-step-off pipeline at ``max_lag=1``).
- :class:`AsyncStream`: the same fixed split with streaming steps: a step takes
  the oldest finished samples as soon as a batch is there and the lag gate is
  open (``tasks/sched/lag.py``); the strongest fixed-split baseline.
- :class:`Elastic`: streaming steps under the same lag bound, plus roles that
  follow the work: waterlevel control on the time to the next step, boundary
  dispatch, core retention, dynamic-membership DP.

Every mode refreshes a rollout cell's weights only when it is about to start
new rollouts there (empty cells first), so no mode pauses running sessions for
weights it does not need, and steps use the DP size that trains fastest
(:func:`~tasks.sched.waterlevel.best_members`) among the cells it has.

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
from tasks.sched.lag import admissible, step_eta, step_ready
from tasks.sched.waterlevel import Marks, best_members, dp_step_seconds, due_signal

SLACK = 0.02  # see Elastic._target_members
TRIP_SHARE = 0.05  # see Elastic._target_members
PATIENCE = 4.0  # a recruit this many times later than expected is not waited for


def step_costs(policy, s: SchedState) -> tuple[float, float]:
    """Seconds per sample on one member and DP cost per member: the run's calibrated
    estimates (``SchedState.costs``) when there are any, else the policy's config."""
    if s.costs is not None:
        return s.costs.train_s_per_sample, s.costs.dp_sync_s
    return policy.train_s_per_sample, policy.dp_sync_s


def _fill(
    cells: list[CellView], cap: int, budget: int, reserved: dict[int, int] | None = None
) -> list[Decision]:
    """StartRollouts on free slots, in the given cell order, at most ``budget``.

    ``reserved``: slots already promised this tick (sessions rerouted there).
    """
    out: list[Decision] = []
    for c in cells:
        if budget <= 0:
            break
        free = cap - c.sessions - (reserved.get(c.id, 0) if reserved else 0)
        if free > 0:
            n = min(free, budget)
            out.append(StartRollouts(c.id, n))
            budget -= n
    return out


def _refresh(stale: list[CellView], cap: int, short: int, version: int) -> list[Decision]:
    """Load ``version`` into stale cells until their free slots cover ``short``.

    Empty cells first (nothing to pause), then those with the fewest sessions.
    """
    out: list[Decision] = []
    for c in sorted(stale, key=lambda c: (c.sessions, c.id)):
        if short <= 0:
            break
        free = cap - c.sessions
        if free > 0:
            out.append(LoadWeights(c.id, version))
            short -= free
    return out


def _rollout_side(s: SchedState, allowed: int, skip: frozenset[int] = frozenset()):
    """Fresh cells to start on, refreshes needed, and the starts that still lack a slot."""
    fresh, stale, soon = [], [], 0
    for c in s.cells:
        if c.role != "rollout" or c.id in skip:
            continue
        if c.busy:  # loading weights: its free slots come back fresh
            soon += s.cap - c.sessions
        elif c.weight_version >= s.version:
            fresh.append(c)
        else:
            stale.append(c)
    free = sum(s.cap - c.sessions for c in fresh) + soon
    loads = _refresh(stale, s.cap, allowed - free, s.version)
    short = allowed - free - sum(s.cap - s.cells[d.cell].sessions for d in loads)
    return fresh, loads, max(0, short)


@dataclass(frozen=True)
class Colocate:
    """Rollout and training take turns on all cells (the colocate baseline, lag 0)."""

    batch: int
    train_s_per_sample: float = 60.0
    dp_sync_s: float = 2.0
    name: str = "colocate"

    def initial_roles(self, n_cells: int) -> tuple[Role, ...]:
        return ("rollout",) * n_cells

    def recommendations(self, s: SchedState) -> list[Decision]:
        if any(c.role in ("draining", "loading") for c in s.cells) or s.step_running:
            return []
        members = best_members(self.batch, *step_costs(self, s), len(s.cells))
        batch_done = s.finished_prefix >= s.trained + self.batch and s.in_flight == 0
        if batch_done:
            train = [c for c in s.cells if c.role == "train"]
            if len(train) < members:  # the last rollout of the batch ended: to training
                return [Move(c.id, "train") for c in s.cells[: members - len(train)]]
            return [StartStep(tuple(c.id for c in train), self.batch, order="index")]
        if s.in_flight == 0 and s.started == s.trained:
            train = [c for c in s.cells if c.role == "train"]
            if train:  # the step is done: back to rollout with the new weights
                return [Move(c.id, "rollout") for c in train]
        queued = max(0, s.trained + self.batch - s.started)
        if queued == 0:
            return []
        fresh, loads, _ = _rollout_side(s, queued)
        return loads + _fill(fresh, s.cap, queued)


@dataclass(frozen=True)
class Async:
    """Fixed split, batch pipeline: step ``b`` trains batch ``b`` (lag <= ``max_lag``)."""

    batch: int
    rollout_cells: int
    max_lag: int = 1
    train_s_per_sample: float = 60.0
    dp_sync_s: float = 2.0
    name: str = "async"

    def initial_roles(self, n_cells: int) -> tuple[Role, ...]:
        if not 1 <= self.rollout_cells < n_cells:
            raise ValueError(
                f"async needs 1 <= rollout_cells < n_cells, got {self.rollout_cells} of {n_cells}"
            )
        return ("rollout",) * self.rollout_cells + ("train",) * (n_cells - self.rollout_cells)

    def recommendations(self, s: SchedState) -> list[Decision]:
        out: list[Decision] = []
        if not s.step_running and s.finished_prefix >= s.trained + self.batch:
            train = [c for c in s.cells if c.role == "train"]
            m = best_members(self.batch, *step_costs(self, s), len(train))
            out.append(StartStep(tuple(c.id for c in train[:m]), self.batch, order="index"))
        # rollout i belongs to batch i // batch and may start only with weights
        # >= that batch - max_lag: (version + max_lag + 1) * batch in all
        allowed = max(0, (s.version + self.max_lag + 1) * self.batch - s.started)
        if allowed == 0:
            return out
        fresh, loads, _ = _rollout_side(s, allowed)
        return out + loads + _fill(fresh, s.cap, allowed)


@dataclass(frozen=True)
class AsyncStream:
    """Fixed split, streaming steps under the lag bound (oldest samples first)."""

    batch: int
    rollout_cells: int
    max_lag: int = 1
    train_s_per_sample: float = 60.0
    dp_sync_s: float = 2.0
    name: str = "async-stream"

    def initial_roles(self, n_cells: int) -> tuple[Role, ...]:
        if not 1 <= self.rollout_cells < n_cells:
            raise ValueError(
                f"async-stream needs 1 <= rollout_cells < n_cells, "
                f"got {self.rollout_cells} of {n_cells}"
            )
        return ("rollout",) * self.rollout_cells + ("train",) * (n_cells - self.rollout_cells)

    def recommendations(self, s: SchedState) -> list[Decision]:
        out: list[Decision] = []
        if step_ready(s, self.batch, self.max_lag):
            train = [c for c in s.cells if c.role == "train"]
            m = best_members(self.batch, *step_costs(self, s), len(train))
            out.append(StartStep(tuple(c.id for c in train[:m]), self.batch, order="oldest"))
        allowed = admissible(s, self.batch, self.max_lag)
        if allowed == 0:
            return out
        fresh, loads, _ = _rollout_side(s, allowed)
        return out + loads + _fill(fresh, s.cap, allowed)


@dataclass(frozen=True)
class Elastic:
    """Streaming steps under a lag bound, with cells moving to where the work is.

    - streaming training under the lag bound: a step takes the oldest finished
      samples once a batch is there and the lag gate is open; rollouts start
      only as admission allows (``tasks/sched/lag.py``).
    - waterlevel control on the time to the next step (``eta``, from the lag
      gate's oldest rollout and the water): ``eta <= marks.low`` staffs
      training up to the fastest DP size; ``eta >= marks.high`` lends idle
      train cells to rollout while admitted rollouts lack a slot; in between
      nothing moves (hysteresis), and a cell keeps a role ``min_dwell_s``; a
      train cell is lent back only once it has joined a step since arriving
      and its own round trip (its measured drain plus the calibrated way back)
      has passed since it arrived (``lend_guard``).
    - cells in transit (issue 25): a recruit arrives at its measured arrival
      time (the run's calibrated drain, ``Costs.drain_s``: call boundaries,
      switch, the executor's own time; ``marks.low`` until one is measured),
      less the time it has been on its way; training is staffed that long
      before the step is due. A step starts with the idle train cells at once
      unless waiting for more (those on their way at their arrival, others as
      their sessions end) makes it end sooner -- but never while a recruit is
      on its way to it (``wait_for_transit``): the recruit's trip is already
      paid and cannot be called back, so starting without it wastes the whole
      round trip for at most its remaining transit saved; only a recruit later
      than ``PATIENCE`` times its expected arrival (a stuck drain) is no longer
      waited for. Fresh recruits are members of the step they came for. While
      it waits only the core takes new rollouts (backpressure), so the other
      cells empty out.
    - boundary dispatch: a rollout cell leaves only if its sessions fit in free
      slots of cells that stay (each moves at its next call boundary, to a cell
      holding weights at least as new); the emptiest cells leave first and new
      rollouts fill the core and the fullest cells first, so sessions pack. A
      train cell leaves between steps.
    - core retention: cells ``0 .. core-1`` always roll out.
    - allocation in blocks of ``block`` cells (1 = per cell; larger is the
      "no per-cell allocation" ablation).
    - sizing from the run's own costs: the step model and a member's round trip
      come from ``SchedState.costs`` (calibrated, ``tasks/sched/costs.py``) and
      training is staffed with the member count whose run is fastest net of
      the round trips its members make (``trip_in_sizing=False``: the ablation
      that counts no trips); while every measured step had one DP size, a ready
      step is staffed one larger (``explore``), else the fit can never tell
      per-sample from per-member cost and keeps the guess's split all run.
    """

    batch: int
    core: int
    train_s_per_sample: float
    dp_sync_s: float
    timeout_s: float
    marks: Marks
    max_lag: int = 1
    min_dwell_s: float = 300.0
    block: int = 1
    streaming: bool = True
    trip_in_sizing: bool = True
    window_from_run: bool = True
    # issue 25's parts, each with its ablation: plan recruits at their measured arrival
    # (else marks.low), wait for recruits in transit, lend back no cell within its trip
    plan_transit: bool = True
    wait_for_transit: bool = True
    lend_guard: bool = True
    explore: bool = True
    name: str = "elastic"

    def _trips_counted(self, s: SchedState) -> bool:
        return self.trip_in_sizing and self._trip(s) >= TRIP_SHARE * self.timeout_s

    def _trip(self, s: SchedState) -> float:
        """Seconds of a cell's round trip rollout -> train -> rollout: measured when the
        run has made both moves, else the marks' dead band (config)."""
        c = s.costs
        if c is not None and c.drain_s is not None and c.to_rollout_s is not None:
            return c.drain_s + c.to_rollout_s
        return self.marks.high - self.marks.low

    def _explore(self, s: SchedState, m: int) -> int:
        """A second DP size while every measured step had the same one (``Costs.sizes``):
        one size cannot tell per-sample from per-member cost, and the guess's split
        stays all run (its best size with it). The next size up (a cheap recruit), else
        down; down first where round trips are counted in sizing (``_trips_counted``):
        one size smaller costs a slower step, one larger a recruit's whole round trip."""
        c = s.costs
        if not self.explore or c is None or c.sizes != (m,):
            return m
        up = m + 1 <= len(s.cells) - self.core
        if m > 1 and (self._trips_counted(s) or not up):
            return m - 1  # where a round trip costs (counted in sizing), a try needs no move
        return m + 1 if up else m

    def _arrival(self, s: SchedState) -> float:
        """Seconds from a Move to training to the cell training: the run's measured drain
        where known (``plan_transit``), never less than ``marks.low`` (the config's)."""
        c = s.costs
        if self.plan_transit and c is not None and c.drain_s is not None:
            return max(self.marks.low, c.drain_s)
        return self.marks.low

    def _marks(self, s: SchedState) -> Marks:
        """The marks with ``low`` at the measured arrival: staff training that early."""
        arr = self._arrival(s)
        if arr <= self.marks.low:
            return self.marks
        return Marks(arr, self.marks.high + arr - self.marks.low)

    def _transit(self, s: SchedState) -> tuple[int, float]:
        """Recruits on their way that a step must wait for, and the longest remaining wait.

        Each arrives ``_arrival`` after its Move, less the time it has been on its way;
        one later than ``PATIENCE`` times that is not counted on (a stuck drain must not
        stall training; it still joins the step after it arrives).
        """
        if not self.wait_for_transit:
            return 0, 0.0
        arr = self._arrival(s)
        n, wait = 0, 0.0
        for c in s.cells:
            if c.target == "train" and s.now - c.since <= PATIENCE * arr:
                n += 1
                wait = max(wait, arr - (s.now - c.since))
        return n, max(0.0, wait)

    def _lendable(self, s: SchedState, c: CellView) -> bool:
        """An idle train cell may go back to rollout: its dwell is over and (``lend_guard``)
        it has joined a step since arriving and its own round trip has passed since then
        (its measured drain, ``move_s``, plus the calibrated way back)."""
        if s.now - c.since < self.min_dwell_s:
            return False
        if not self.lend_guard:
            return True
        if c.fresh:
            return False
        co = s.costs
        back = co.to_rollout_s if co is not None and co.to_rollout_s is not None else None
        there = c.move_s if c.move_s is not None else self._arrival(s)
        trip = there + (back if back is not None else self.marks.high - self.marks.low)
        return s.now - c.arrived >= trip

    def initial_roles(self, n_cells: int) -> tuple[Role, ...]:
        if not 1 <= self.core < n_cells:
            raise ValueError(f"elastic needs 1 <= core < n_cells, got {self.core} of {n_cells}")
        return ("rollout",) * n_cells

    def _blocks(self, cells: list[CellView]) -> list[list[CellView]]:
        """Group non-core cells into allocation blocks (by id); keep whole ones only."""
        groups: dict[int, list[CellView]] = {}
        for c in cells:
            groups.setdefault((c.id - self.core) // self.block, []).append(c)
        return [g for g in groups.values() if len(g) == self.block]

    def recommendations(self, s: SchedState) -> list[Decision]:
        out: list[Decision] = []
        b, lag, cap = self.batch, self.max_lag, s.cap
        n = len(s.cells)
        m_best = self._target_members(s)
        stepping = s.step_running
        if self.streaming:
            ready = step_ready(s, b, lag)
        else:  # ablation: wait for the next batch by index, like Async
            ready = not stepping and s.finished_prefix >= s.trained + b
        allowed = admissible(s, b, lag)
        if not ready and allowed == 0 and self._signal(s, stepping) <= 0:
            return out  # nothing to start, no step near: nothing to decide (most ticks)

        idle_train: list[CellView] = []
        n_train = 0  # in training or on the way there
        moving = False
        for c in s.cells:
            if c.role == "train" or c.target == "train":
                n_train += 1
                if c.role == "train" and not c.busy:
                    idle_train.append(c)
            if c.target is not None:
                moving = True

        # 1. the step: start with the idle train cells, unless waiting for the
        # cells that can join (at their measured arrival) makes the step end
        # sooner; never while a recruit is on its way to it
        leaving: set[int] = set()
        reserved: dict[int, int] = {}
        recruits: list[Decision] = []
        if ready:
            m_best = self._explore(s, m_best)
            n_transit, wait = self._transit(s)
            if n_train < m_best:
                recruits = self._recruit(s, m_best - n_train, leaving, reserved)
            m_now = min(len(idle_train), m_best)
            m_soon = min(m_best, n_train + len(recruits))
            m_wait = min(m_best, len(idle_train) + n_transit)  # here once the transit lands
            m = self._members(s, m_now, m_soon, m_best, wait, n_transit > 0, m_wait)
            if m_now and n_transit == 0 and m == m_now:
                recruits, leaving, reserved = [], set(), {}  # not worth the wait
                order = "oldest" if self.streaming else "index"
                if m_now == m_best and self._trips_counted(s):
                    # cells already in training cost no further trip: use them
                    t, sync = step_costs(self, s)
                    m_now = min(len(idle_train), max(m_best, best_members(b, t, sync, n)))
                # recruits that came for this step are its members, whatever the size
                idle_train.sort(key=lambda c: not c.fresh)
                m_now = max(m_now, sum(1 for c in idle_train if c.fresh))
                out.append(StartStep(tuple(c.id for c in idle_train[:m_now]), b, order=order))
                stepping = True
                idle_train = idle_train[m_now:]
            elif m > m_wait:  # more cells than those already coming are worth the wait
                out += recruits
            else:
                recruits, leaving, reserved = [], set(), {}

        # 2. waterlevel on the time until the next step can start: staff
        # training when it is near, lend its idle cells to rollout when far
        sig = self._signal(s, stepping)
        if sig > 0 and n_train < m_best and not (ready or stepping):
            out += self._recruit(s, m_best - n_train, leaving, reserved)
        elif sig < 0 and idle_train and allowed > 0 and not moving:
            _, _, short = _rollout_side(s, allowed)
            spare = [c for c in idle_train if self._lendable(s, c)]
            for g in self._blocks(spare):
                if short <= 0:
                    break
                out += [Move(c.id, "rollout") for c in g]
                short -= cap * len(g)

        # 3. rollouts: refresh what starts need, start what admission allows;
        # while training waits for cells, only the core takes new sessions
        if allowed == 0:
            return out
        skip = set(leaving)
        if (ready or sig > 0) and n_train + len(leaving) < m_best:
            skip.update(range(self.core, n))
        fresh, loads, _ = _rollout_side(s, allowed, frozenset(skip))
        # core first, then fuller cells first: sessions pack, non-core cells empty out
        fresh.sort(key=lambda c: (c.id >= self.core, -c.sessions, c.id))
        return out + loads + _fill(fresh, cap, allowed, reserved)

    def _target_members(self, s: SchedState) -> int:
        """DP members to staff training with: the size whose run is fastest.

        Per step the run needs at least ``(timeout + d(m)) / (L + 1)`` (the lag
        window, ``tasks/sched/bound.py``), ``d(m)`` (steps run one at a time)
        and ``(batch * mean_duration / cap + batch * t + sync * m^2) / cells``
        (capacity: the rollouts' slot time plus the step's cell time). Each
        member also makes a round trip (``trip`` s: drain, switch, weight load,
        measured by the run's cost model) per ``L + 1`` steps: ``trip * m / (L + 1)``
        cell-seconds per step, added to both (in the lag window as what it costs
        the pool, ``/ cells``). The first two fall with ``m`` up to the fastest
        step net of trips, the last rises: the best ``m`` is where they cross.
        ``d`` and ``t`` come from the calibrated costs (``SchedState.costs``).
        Without a duration yet, the fastest step net of trips.
        """
        b, (t, sync) = self.batch, step_costs(self, s)
        n, per = len(s.cells), self.max_lag + 1
        # a member makes one round trip per L + 1 steps (recruited for a run of
        # steps, lent out after it): cell time the pool pays per step. Counted
        # where a round trip is at least TRIP_SHARE of the rollout cap (a lent
        # cell's late rollouts then show at the lag gate: costly switches);
        # below that, staffing for the fastest step paid more in every row we ran
        trip = self._trip(s) if self._trips_counted(s) else 0.0
        gross = best_members(b, t, sync, n - self.core)

        # the lag window: the cap, or the longest recent rollout where they end sooner
        window = self.timeout_s
        if self.window_from_run and s.longest_duration > 0:
            window = min(window, s.longest_duration)

        def lag_time(m: int) -> float:
            d = dp_step_seconds(b, m, t, sync)
            return max((window + d) / per, d) + trip * m / (per * n)

        def cap_time(m: int) -> float:
            return (b * s.mean_duration / s.cap + b * t + sync * m * m + trip * m / per) / n

        # the fastest step, less what its members' round trips cost the pool
        fastest = _argmin(lag_time, 1, gross)
        if s.mean_duration <= 0:
            return fastest

        if lag_time(fastest) >= cap_time(fastest):
            return fastest
        # the crossing: the first m where capacity, not the lag window, binds
        cross = _first(lambda m: lag_time(m) <= cap_time(m), 1, fastest)
        best = min(max(lag_time(m), cap_time(m)) for m in {max(1, cross - 1), cross})
        # past it the time rises slowly (the sync cost): take the largest m within
        # SLACK of the best, so steps stay short when the durations move
        over = _first(lambda m: cap_time(m) > best * (1 + SLACK), cross, fastest + 1)
        return max(cross, over - 1)

    def _signal(self, s: SchedState, stepping: bool) -> int:
        """Waterlevel signal on the time until the next step can start.

        ``stepping``: a step runs or was booked this tick (its samples are
        gone, the next step starts from the version after it).
        """
        b = self.batch
        next_version = s.version + 1 if stepping else s.version
        if self.streaming:
            taken = b if stepping and not s.step_running else 0  # booked this tick
            eta = step_eta(s, b, self.max_lag, self.timeout_s, next_version, taken)
        else:
            due = s.finished_prefix >= s.trained + (2 if stepping else 1) * b
            eta = 0.0 if due else self.marks.high
        return due_signal(eta, self._marks(s))

    def _members(
        self,
        s: SchedState,
        m_now: int,
        m_soon: int,
        m_best: int,
        wait: float = 0.0,
        transit: bool = False,
        m_wait: int = 0,
    ) -> int:
        """Members to start a ready step with: now, or after waiting for more.

        ``transit``: recruits are on their way, the step waits ``wait`` s for them
        anyway, and ``m_wait`` cells are there then. New recruits arrive at the
        measured arrival (``_arrival``); beyond them, a cell empties about every
        ``cap`` rollout finishes. Picks the member count whose wait plus step time
        is least.
        """
        b, (t, sync) = self.batch, step_costs(self, s)
        per_cell = s.cap / s.finish_rate if s.finish_rate > 0 else math.inf
        arrival = self._arrival(s)

        def total(m: int) -> float:
            if m <= m_now and not transit:
                return dp_step_seconds(b, m, t, sync)
            if transit and m <= m_wait:
                return wait + dp_step_seconds(b, m, t, sync)
            late = max(wait, arrival) + max(0, m - m_soon) * per_cell
            return late + dp_step_seconds(b, m, t, sync)

        # wait + step time is convex in m: its minimum is near sqrt(b t / (sync + per_cell))
        cands = {m_now, m_soon, m_best, m_wait}
        if per_cell < math.inf:
            x = math.sqrt(b * t / (sync + per_cell))
            cands.update({math.floor(x), math.ceil(x)})
        cands = {m for m in cands if m_now <= m <= m_best and m >= 1}
        return min(cands, key=lambda m: (total(m), m))

    def _candidates(self, s: SchedState) -> list[list[CellView]]:
        cells = [
            c
            for c in s.cells[self.core :]
            if c.role == "rollout" and not c.busy and s.now - c.since >= self.min_dwell_s
        ]
        return sorted(self._blocks(cells), key=lambda g: (sum(c.sessions for c in g), g[0].id))

    def _recruit(
        self, s: SchedState, want: int, leaving: set[int], reserved: dict[int, int]
    ) -> list[Decision]:
        """Move up to ``want`` non-core rollout cells to training, emptiest first.

        As many go as the cells that stay (core first) can take their sessions
        in free slots; a session goes only to a cell holding weights at least
        as new as its own, so no token gets older.
        """
        cands = self._candidates(s)
        free_all = sum(s.cap - c.sessions for c in s.cells if c.role == "rollout")
        # leavers are a prefix of the emptiest blocks: the most that fit
        chosen: list[list[CellView]] = []
        k = moved = 0
        free_keep = free_all
        for g in cands:
            if k >= want:
                break
            sess = sum(c.sessions for c in g)
            own = sum(s.cap - c.sessions for c in g)
            if moved + sess > free_keep - own:
                break
            chosen.append(g)
            k += len(g)
            moved += sess
            free_keep -= own
        go = {c.id for g in chosen for c in g}
        slots = [
            [c.id, s.cap - c.sessions]
            for c in s.cells
            if c.role == "rollout" and c.sessions < s.cap and c.id not in go
        ]
        first = 0  # slots[:first] are full
        out: list[Decision] = []
        for g in chosen:
            plan: list[tuple[int, tuple[tuple[int, int], ...]]] = []
            taken: list[tuple[int, int]] = []
            for c in g:
                reroute, need = [], c.sessions
                j = first
                while need and j < len(slots):
                    tgt, free = slots[j]
                    if free and s.cells[tgt].weight_version >= c.weight_version:
                        k = min(need, free)
                        reroute.append((tgt, k))
                        taken.append((j, k))
                        slots[j][1] -= k
                        need -= k
                    j += 1
                if need:
                    break
                plan.append((c.id, tuple(reroute)))
            if len(plan) < len(g):  # give the slots back; fuller cells do not fit either
                for j, k in taken:
                    slots[j][1] += k
                break
            while first < len(slots) and slots[first][1] == 0:
                first += 1
            out += [Move(cid, "train", reroute=r) for cid, r in plan]
            leaving.update(cid for cid, _ in plan)
            for _, r in plan:
                for tgt, k in r:
                    reserved[tgt] = reserved.get(tgt, 0) + k
        return out


def _argmin(f, lo: int, hi: int) -> int:
    """The smallest m in [lo, hi] minimising f (f convex on the integers)."""
    while hi - lo > 2:
        a, b = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if f(a) <= f(b):
            hi = b
        else:
            lo = a
    return min(range(lo, hi + 1), key=lambda m: (f(m), m))


def _first(pred, lo: int, hi: int) -> int:
    """The smallest m in [lo, hi] with pred(m) (pred monotone); hi if none before it."""
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def core_cells(n_cells: int, frac: float) -> int:
    """Core size for a pool: ``ceil(frac * n)``, at least 1 and at most n - 1."""
    return max(1, min(n_cells - 1, math.ceil(frac * n_cells)))
