"""Elastic Scheduler core: state, events, decisions and the coordinator.

Policy vs mechanism (STYLE.md habit 4, cf. dask's ``AdaptiveCore``): a policy
(see ``tasks/modes.py``) looks at a frozen :class:`SchedState` and returns
decisions as plain data (``Move``, ``LoadWeights``, ``StartStep``,
``StartRollouts``). An executor — the discrete-event simulator here, Dask cells
later — carries them out and reports back with events. The
:class:`Coordinator` is the only thing with state, and it changes only through
``handle(event) -> decisions``, so the same policy drives 8 CPU cells and 1,000
simulated GPUs, and is tested without a cluster.

Bookkeeping happens at decision time: a ``StartRollouts`` counts its sessions at
once, a ``Move`` of a rollout cell re-assigns (reserves) its sessions to the
cells named in ``reroute`` at once, a ``StartStep`` takes its samples off the
water level at once. Completion events only close what a decision opened.

Rollouts are numbered in start order (``StartRollouts(cell, n)`` starts the
next ``n`` numbers) and each carries a *base version*: the oldest policy
version among its tokens (the version of the cell it started on, or the one
the executor reports when it finishes). A step starting from weights ``w``
trains a rollout of base ``u`` at policy lag ``w - u``; the coordinator keeps,
per base version, how many rollouts are in flight and finished-untrained
(``SchedState.versions``), which is all a policy needs to bound the lag, and it
names the rollouts each step trains (``StartStep.rollouts``).

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from tasks.sched.costs import CostEstimator, Costs

Role = Literal["rollout", "train", "draining", "loading"]


@dataclass(frozen=True, slots=True)
class CellView:
    """One cell as the policy sees it.

    ``busy``: a train cell is inside an optimizer step, or a rollout cell is
    loading new weights (its sessions are paused). ``sessions`` counts live
    agent sessions assigned to the cell (including ones rerouted to it and not
    yet arrived). ``target`` is where a draining/loading cell is going;
    ``since`` when its last role change was decided (a cell in transit has been
    on its way ``now - since`` s).

    Arrivals, kept by the coordinator from the events executors send today:
    ``arrived`` is when the cell got its current role (its last ``MoveDone``; 0
    for the initial roles), ``move_s`` how long that move took (the event's
    ``seconds``, else decision to arrival on the coordinator's clock; ``None``
    for the initial roles), and ``fresh`` marks a train cell that has not yet
    joined a step since it arrived: a recruit whose step has not started.
    """

    id: int
    role: Role
    busy: bool = False
    sessions: int = 0
    weight_version: int = 0
    since: float = 0.0
    target: Role | None = None
    arrived: float = 0.0
    move_s: float | None = None
    fresh: bool = False


@dataclass(frozen=True, slots=True)
class VersionCount:
    """Rollouts of one base version not yet trained.

    ``oldest_start``: start time of the oldest one still in flight (``inf``
    when none is): it cannot run past ``oldest_start + timeout`` plus pauses.
    """

    version: int
    in_flight: int
    finished: int
    oldest_start: float = math.inf


@dataclass(frozen=True, slots=True)
class SchedState:
    """Snapshot the policies decide on.

    ``water_level``: finished samples not yet trained. ``finished_prefix``: the
    longest prefix of rollouts (by start index) that have all finished — what a
    batch-synchronous mode needs to know a batch is complete. ``started`` and
    ``trained`` count rollouts; ``version`` is the newest policy version.
    ``finish_rate``: rollouts finishing per second, smoothed over
    ``Coordinator.rate_tau_s`` — what the elastic policy sizes training by.
    ``versions``: untrained rollouts per base version, oldest first (see
    :class:`VersionCount`). ``published_at``: when ``version`` was published
    (the end of the last step; 0 for version 0). ``mean_duration``: how long
    a rollout holds its slot, start to finish, averaged over about the last
    ``Coordinator.duration_window`` finished rollouts (0 before any);
    ``longest_duration``: the longest of the last ``duration_window``
    (0 before any) -- how long a lag gate waits, where rollouts end before the cap.
    ``costs``: the cost model calibrated from this run's steps, role changes
    and weight loads (``tasks/sched/costs.py``; ``None`` when the coordinator
    has no estimator): policies size training and set their marks from it.
    """

    now: float
    cells: tuple[CellView, ...]
    cap: int
    water_level: int
    in_flight: int
    started: int
    trained: int
    finished_prefix: int
    version: int
    step_running: bool
    finish_rate: float = 0.0
    versions: tuple[VersionCount, ...] = ()
    published_at: float = 0.0
    mean_duration: float = 0.0
    costs: Costs | None = None
    longest_duration: float = 0.0

    def count(self, role: Role) -> int:
        return sum(1 for c in self.cells if c.role == role)


# ---- decisions (plain data) ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartRollouts:
    """Start ``n`` new agent sessions on rollout cell ``cell``."""

    cell: int
    n: int


@dataclass(frozen=True, slots=True)
class Move:
    """Change ``cell``'s role at its next boundary.

    A rollout cell leaves between requests of its sessions: each session's next
    call goes to the cell named in ``reroute`` (``(cell, n_sessions)`` pairs,
    covering all its sessions). A train cell leaves only between optimizer
    steps (the policy never moves a busy one).
    """

    cell: int
    to: Literal["rollout", "train"]
    at: Literal["boundary"] = "boundary"
    reroute: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class LoadWeights:
    """Load policy ``version`` into rollout cell ``cell`` (its sessions pause)."""

    cell: int
    version: int


@dataclass(frozen=True, slots=True)
class StartStep:
    """One optimizer step over ``cells`` (the DP members) on ``samples`` samples.

    ``order``: ``"index"`` trains the next rollouts by start index (a batch
    whose every member finished), ``"finish"`` the earliest finished ones
    (streaming), ``"oldest"`` the finished ones of the oldest base version
    first, by finish time within a version (streaming under a lag bound).
    ``rollouts``: left empty by policies; the coordinator fills in the rollout
    numbers the step trains when it books the step, so the executor trains
    exactly those.
    """

    cells: tuple[int, ...]
    samples: int
    order: Literal["index", "finish", "oldest"] = "finish"
    rollouts: tuple[int, ...] = ()


Decision = StartRollouts | Move | LoadWeights | StartStep


# ---- events (what the executor reports) --------------------------------------------


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed; the coordinator asks the policy for decisions."""

    now: float


@dataclass(frozen=True, slots=True)
class RolloutFinished:
    """Rollout number ``index`` ended (done or timed out; either way scored).

    ``version``: the oldest policy version among its tokens, when the executor
    knows it (a session moved to, or paused on, a cell with older weights);
    ``None`` keeps the version the coordinator booked at its start.
    """

    cell: int
    index: int
    version: int | None = None


# ``seconds`` on the events below: how long the executor took to carry the decision out,
# from when it received it to this event (for the cost model, tasks/sched/costs.py). An
# executor that leaves it ``None`` is timed on the coordinator's clock instead (decision
# tick to the last tick before the event). Not part of an event's equality.


@dataclass(frozen=True, slots=True)
class MoveDone:
    """``cell`` finished its role change (drain/load) and now has its new role.

    ``seconds``: from the ``Move`` to now (a drain: the sessions' call boundaries,
    the switch; to rollout: the switch and the weight load).
    """

    cell: int
    seconds: float | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class WeightsLoaded:
    """``cell`` holds weights ``version``; ``seconds``: from the ``LoadWeights`` to now."""

    cell: int
    version: int
    seconds: float | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class StepFinished:
    """The step over ``cells`` ended; ``seconds``: from the ``StartStep`` to now (wall
    time of the step, DP group formation included)."""

    cells: tuple[int, ...]
    seconds: float | None = field(default=None, compare=False)


Event = Tick | RolloutFinished | MoveDone | WeightsLoaded | StepFinished


class Policy(Protocol):
    """The verbs every scheduling mode has (no base class; see tasks/modes.py)."""

    name: str

    def initial_roles(self, n_cells: int) -> tuple[Role, ...]: ...

    def recommendations(self, state: SchedState) -> list[Decision]: ...


# ---- the coordinator -----------------------------------------------------------------


@dataclass
class _Cell:
    role: Role
    busy: bool = False
    sessions: int = 0
    weight_version: int = 0
    since: float = 0.0
    target: Role | None = None
    arrived: float = 0.0
    move_s: float | None = None
    fresh: bool = False


@dataclass
class Coordinator:
    """Holds the scheduler's state; changes only through :meth:`handle`.

    ``handle(Tick)`` returns the policy's decisions (already booked in the
    state; a ``StartStep`` comes back with its ``rollouts`` filled in); other
    events only update the state and return ``[]``, so an executor may feed
    many events and then one tick.

    ``costs``: the cost estimator (``tasks/sched/costs.py``) fed by step, move and
    weight-load events; by default seeded from the policy's ``train_s_per_sample`` and
    ``dp_sync_s`` (none when the policy has no such guesses). ``calibrate=False`` keeps
    the guesses all run (the ablation).
    """

    policy: Policy
    n_cells: int
    cap: int
    now: float = 0.0
    water_level: int = 0
    in_flight: int = 0
    started: int = 0
    trained: int = 0
    version: int = 0
    step_running: bool = False
    finish_rate: float = 0.0
    rate_tau_s: float = 1800.0
    published_at: float = 0.0
    _finished_since_tick: int = 0
    # rollouts finish in bursts and the long ones last, so the mean is taken
    # over finishes, not time: about two pools' worth of slots (0 = that)
    duration_window: int = 0
    mean_duration: float = 0.0
    _n_done: int = 0
    # the last duration_window durations, and a monotone deque of (index, duration)
    # for their maximum
    _long_q: deque[tuple[int, float]] = field(default_factory=deque)
    _cells: list[_Cell] = field(default_factory=list)
    _finished: set[int] = field(default_factory=set)
    finished_prefix: int = 0
    # CellViews are rebuilt only for cells changed since the last snapshot, so a
    # tick over 1,000 cells costs O(changed), not O(n) object constructions
    _views: list[CellView] = field(default_factory=list)
    _dirty: set[int] = field(default_factory=set)
    # per rollout: base version and start time while in flight; base version
    # while finished and untrained
    _flying: dict[int, tuple[int, float]] = field(default_factory=dict)
    _untrained: dict[int, int] = field(default_factory=dict)
    # per base version: in-flight rollouts in start order and finished ones in
    # finish order (both with lazy deletion), and the counts
    _fly_q: dict[int, deque[int]] = field(default_factory=dict)
    _fin_q: dict[int, deque[int]] = field(default_factory=dict)
    _n_fly: dict[int, int] = field(default_factory=dict)
    _n_fin: dict[int, int] = field(default_factory=dict)
    _finish_order: deque[int] = field(default_factory=deque)
    _next_index: int = 0
    costs: CostEstimator | None = None
    calibrate: bool = True
    # what the cost model measures: the running step (start, samples, members), the
    # last step's members, when each cell's move or weight load was decided
    _step: tuple[float, int, tuple[int, ...]] | None = None
    _last_members: tuple[int, ...] = ()
    _load_since: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.n_cells < 1 or self.cap < 1:
            raise ValueError(f"need n_cells >= 1 and cap >= 1, got {self.n_cells}, {self.cap}")
        if self.costs is None:
            t = getattr(self.policy, "train_s_per_sample", None)
            sync = getattr(self.policy, "dp_sync_s", None)
            if isinstance(t, int | float) and isinstance(sync, int | float) and t > 0:
                self.costs = CostEstimator(float(t), float(sync))
        if self.costs is not None and not self.calibrate:
            self.costs.learn = False
        if self.duration_window <= 0:
            self.duration_window = 2 * self.n_cells * self.cap
        roles = self.policy.initial_roles(self.n_cells)
        self._cells = [_Cell(role=r) for r in roles]
        self._views = [self._view(i) for i in range(self.n_cells)]

    # -- views
    def _view(self, i: int) -> CellView:
        c = self._cells[i]
        return CellView(
            i, c.role, c.busy, c.sessions, c.weight_version, c.since, c.target,
            c.arrived, c.move_s, c.fresh,
        )  # fmt: skip

    def _versions(self) -> tuple[VersionCount, ...]:
        out = []
        for v in sorted(set(self._n_fly) | set(self._n_fin)):
            nf, nd = self._n_fly.get(v, 0), self._n_fin.get(v, 0)
            if nf == 0 and nd == 0:
                continue
            oldest = math.inf
            if nf:
                q = self._fly_q[v]
                while q[0] not in self._flying:
                    q.popleft()
                oldest = self._flying[q[0]][1]
            out.append(VersionCount(v, nf, nd, oldest))
        return tuple(out)

    def state(self) -> SchedState:
        for i in self._dirty:
            self._views[i] = self._view(i)
        self._dirty.clear()
        return SchedState(
            now=self.now,
            cells=tuple(self._views),
            cap=self.cap,
            water_level=self.water_level,
            in_flight=self.in_flight,
            started=self.started,
            trained=self.trained,
            finished_prefix=self.finished_prefix,
            version=self.version,
            step_running=self.step_running,
            finish_rate=self.finish_rate,
            versions=self._versions(),
            published_at=self.published_at,
            mean_duration=self.mean_duration,
            longest_duration=self._long_q[0][1] if self._long_q else 0.0,
            costs=self.costs.snapshot() if self.costs is not None else None,
        )

    def cell(self, i: int) -> CellView:
        return self._view(i)

    # -- the one entry
    def handle(self, event: Event) -> list[Decision]:
        if isinstance(event, Tick):
            dt = event.now - self.now
            if dt > 0:
                a = 1.0 - math.exp(-dt / self.rate_tau_s)
                self.finish_rate += a * (self._finished_since_tick / dt - self.finish_rate)
                self._finished_since_tick = 0
            self.now = max(self.now, event.now)
            return [self._book(d) for d in self.policy.recommendations(self.state())]
        if isinstance(event, RolloutFinished):
            self._dirty.add(event.cell)
            c = self._cells[event.cell]
            assert c.sessions > 0, f"cell {event.cell} has no session to finish"
            assert event.index in self._flying, f"rollout {event.index} is not in flight"
            c.sessions -= 1
            self.in_flight -= 1
            self.water_level += 1
            self._finished_since_tick += 1
            base, start = self._flying.pop(event.index)
            self._n_done += 1
            k = min(self._n_done, self.duration_window)
            self.mean_duration += (self.now - start - self.mean_duration) / k
            q, dur = self._long_q, self.now - start
            while q and q[-1][1] <= dur:
                q.pop()
            q.append((self._n_done, dur))
            while q[0][0] <= self._n_done - self.duration_window:
                q.popleft()
            self._n_fly[base] -= 1
            if event.version is not None:
                base = min(base, event.version)
            self._untrained[event.index] = base
            self._fin_q.setdefault(base, deque()).append(event.index)
            self._n_fin[base] = self._n_fin.get(base, 0) + 1
            self._finish_order.append(event.index)
            self._finished.add(event.index)
            while self.finished_prefix in self._finished:
                self._finished.discard(self.finished_prefix)
                self.finished_prefix += 1
        elif isinstance(event, MoveDone):
            self._dirty.add(event.cell)
            c = self._cells[event.cell]
            assert c.target is not None, f"cell {event.cell} was not moving"
            secs = self.now - c.since if event.seconds is None else event.seconds
            if self.costs is not None:
                (self.costs.drain if c.target == "train" else self.costs.to_rollout)(secs)
            c.arrived, c.move_s, c.fresh = self.now, secs, c.target == "train"
            c.role, c.target, c.busy = c.target, None, False
            # a cell joining rollout gets the newest weights first; a train cell
            # holds the newest weights by construction
            c.weight_version = self.version
        elif isinstance(event, WeightsLoaded):
            self._dirty.add(event.cell)
            c = self._cells[event.cell]
            c.busy = False
            c.weight_version = max(c.weight_version, event.version)
            since = self._load_since.pop(event.cell, None)
            if self.costs is not None and (event.seconds is not None or since is not None):
                self.costs.weight_load(self.now - since if event.seconds is None else event.seconds)
        elif isinstance(event, StepFinished):
            if self.costs is not None and self._step is not None:
                t0, samples, members = self._step
                secs = self.now - t0 if event.seconds is None else event.seconds
                regrouped = bool(self._last_members) and set(members) != set(self._last_members)
                self.costs.step(samples, len(members), secs, regrouped)
                self._last_members = members
            self._step = None
            self.step_running = False
            self.version += 1
            self.published_at = self.now
            self._dirty.update(event.cells)
            for i in event.cells:
                self._cells[i].busy = False
                self._cells[i].weight_version = self.version
        else:  # pragma: no cover - typing guards this
            raise TypeError(f"unknown event {event!r}")
        return []

    def _book(self, d: Decision) -> Decision:
        if isinstance(d, StartRollouts):
            self._dirty.add(d.cell)
            c = self._cells[d.cell]
            assert c.role == "rollout" and not c.busy, f"rollouts on unavailable cell {d.cell}"
            assert c.sessions + d.n <= self.cap, f"cell {d.cell} over its concurrency cap"
            c.sessions += d.n
            self.in_flight += d.n
            self.started += d.n
            v = c.weight_version
            q = self._fly_q.setdefault(v, deque())
            for i in range(self._next_index, self._next_index + d.n):
                self._flying[i] = (v, self.now)
                q.append(i)
            self._next_index += d.n
            self._n_fly[v] = self._n_fly.get(v, 0) + d.n
        elif isinstance(d, Move):
            self._dirty.add(d.cell)
            self._dirty.update(t for t, _ in d.reroute)
            c = self._cells[d.cell]
            assert not c.busy, f"Move of busy cell {d.cell} (boundary dispatch)"
            assert c.role in ("rollout", "train") and c.role != d.to
            assert sum(n for _, n in d.reroute) == c.sessions, "reroute must cover all sessions"
            for t, n in d.reroute:
                tc = self._cells[t]
                assert tc.role == "rollout" and t != d.cell
                tc.sessions += n
                assert tc.sessions <= self.cap, f"reroute over cell {t}'s concurrency cap"
            c.sessions = 0
            c.role = "draining" if c.role == "rollout" else "loading"
            c.target = d.to
            c.since = self.now
        elif isinstance(d, LoadWeights):
            self._dirty.add(d.cell)
            c = self._cells[d.cell]
            assert c.role == "rollout" and not c.busy
            c.busy = True
            self._load_since[d.cell] = self.now
        elif isinstance(d, StartStep):
            assert not self.step_running, "one optimizer step at a time"
            assert d.samples <= self.water_level
            self._dirty.update(d.cells)
            for i in d.cells:
                c = self._cells[i]
                assert c.role == "train" and not c.busy, f"cell {i} cannot join a step"
                c.busy, c.fresh = True, False
            self.step_running = True
            self._step = (self.now, d.samples, tuple(d.cells))
            self.water_level -= d.samples
            self.trained += d.samples
            d = replace(d, rollouts=self._take(d.samples, d.order))
        return d

    def _take(self, n: int, order: str) -> tuple[int, ...]:
        """The ``n`` finished, untrained rollouts a step of ``order`` trains."""
        out: list[int] = []
        if order == "index":
            i = self.trained - n  # the step's first index (trained already counts it)
            out = list(range(i, i + n))
            missing = [j for j in out if j not in self._untrained]
            assert not missing, f"index-order step needs unfinished rollouts {missing[:3]}"
        elif order == "finish":
            q = self._finish_order
            while len(out) < n:
                j = q.popleft()
                if j in self._untrained:
                    out.append(j)
        else:  # oldest base version first, finish order within one
            for v in sorted(self._fin_q):
                q = self._fin_q[v]
                while q and len(out) < n:
                    j = q.popleft()
                    if j in self._untrained:
                        out.append(j)
                if len(out) == n:
                    break
        for j in out:
            v = self._untrained.pop(j)
            self._n_fin[v] -= 1
        for v in [v for v, k in self._n_fin.items() if k == 0 and self._n_fly.get(v, 0) == 0]:
            self._n_fin.pop(v)
            self._n_fly.pop(v, None)
            self._fin_q.pop(v, None)
            self._fly_q.pop(v, None)
        return tuple(out)
