"""The one door through which scheduling decisions reach the cells.

The coordinator (tasks/sched/coordinator.py) decides; this executor carries each decision
out on the real machinery and reports back with events, like the simulator does in
simulation (dask's adaptive core and worker state machine work the same way):

- ``StartRollouts(cell, n)``: start ``n`` groups (Prefect tasks, through the ``Work`` port);
  a finished group is processed, its samples go to the buffer, then ``RolloutFinished``.
- ``Move(cell, "train")``: the cell's Dask resources go to none (no new rollout work), the
  gateway withdraws its engine at the next call boundary of each session (in-flight calls
  finish; each group's next calls go to the cell the ``Move``'s ``reroute`` names for it,
  as the coordinator booked it, with their KV moved, or re-prefilled, counted), the engine
  is parked (KV freed), the cell takes the ``train`` resource and joins the next step's
  data-parallel group; then ``MoveDone``.
- ``Move(cell, "rollout")`` (between optimizer steps): the cell leaves the DP group, its
  engine (parked, or started) loads the newest weights *before* the gateway routes to it,
  then it takes the ``rollout`` resource; then ``MoveDone``.
- ``LoadWeights(cell, v)``: the engine loads the run's checkpoint ``run_version(v)`` (calls
  in flight continue after a transparent resubmit); then ``WeightsLoaded``. Decisions and
  events count versions as the coordinator does, from 0 at this invocation's start; the
  executor's own state, the store and the engines count the run's versions.
- ``StartStep(cells, n)``: ``n`` buffered groups, one data-parallel step over ``cells``
  (a new DP generation whenever the members changed); then ``StepFinished``.

Control-plane actions run on a small thread pool so the loop never blocks on a drain or a
weight load, and the parts of one role change that need not wait for each other run beside
each other (``together``: the gateway's withdrawal and the Dask role, the engine's load and
leaving the DP group). Units of work are asked for through the ``Work`` port, which hands
back a ``Job`` at once (the flow's port makes its Prefect submits on a thread of its own:
flows/submits.py); a group's end (its result, its sessions ended at the gateway, the store
flushed, processing asked for) is handled off the loop too, in the order groups end, and
processing goes to the steady rollout cells (``process_addrs``). Every
decision and role change is a ``cells`` row with its reason and its measured costs, written
off the loop in order (infra/cells/cells_log.py); every wait has a bound and its error names
what it waited for. ``Stats.loop_s`` is the loop's own time per decision and event kind,
``Stats.off_loop_s`` what a group's end costs beside it.

Faults (the coordinator never sees them): lost cells are healed, aborted steps retried and
tasks that no cell can take stop the run; `infra.cells.healing` holds that part, and
`infra.cells.membership` keeps the books.
"""

from __future__ import annotations

import logging
import math
import queue
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from infra.cells.cells_log import CellsLog
from infra.cells.cluster import Cells
from infra.cells.engines import engine_stats, load_weights, park_engine, start_engine
from infra.cells.healing import ExecutorError, Healing
from infra.cells.membership import Membership
from storage.store import Store
from tasks.sched.coordinator import (
    Decision,
    Event,
    LoadWeights,
    Move,
    MoveDone,
    RolloutFinished,
    StartRollouts,
    StartStep,
    StepFinished,
    WeightsLoaded,
)
from tasks.train.dp import StepPlan, host_store

log = logging.getLogger(__name__)


class Job(Protocol):
    """A unit of work in flight (a Prefect task on Dask, adapted by the flow)."""

    def done(self) -> bool: ...

    def result(self) -> Any: ...

    def add_done_callback(self, fn: Callable[[], None]) -> None: ...

    def cancel(self) -> None: ...


class Work(Protocol):
    """How the executor starts units of work; the flow implements it with Prefect tasks."""

    def rollout(self, index: int, cell_id: str) -> Job: ...

    def process(
        self, index: int, sessions: Any, version: int, workers: tuple[str, ...] = ()
    ) -> Job: ...  # on one of ``workers`` while any is up (none named: anywhere)

    def step(self, plan: StepPlan) -> list[Job]: ...  # one job per member, on plan.workers


@dataclass(frozen=True)
class EngineSpec:
    """How a cell's engine is started (the ``model`` section and the pacing)."""

    model_dir: str
    max_batch_size: int = 16
    kv_cache_tokens: int = 262_144
    audit_dir: str | None = None
    decode_step_s: float = 0.0
    prefill_tokens_per_s: float = 0.0


@dataclass
class Group:
    """One rollout group the executor started: where it is booked, what it has become."""

    index: int
    cell: int  # the logical cell (the coordinator's books, incl. reroutes)
    t_start: float
    phase: str = "rollout"  # rollout | process | buffered | trained
    job: Job | None = None
    sessions: Any = None
    processed: Any = None  # ProcessedStep-like: samples_segment, sample_ids, n_samples
    t_done: float = 0.0
    t_rollout: float = 0.0  # wall clock: its rollout task ended (processing starts)
    deadline: float = math.inf  # monotonic: its rollout or processing must be done by then


@dataclass
class Stats:
    """What the executor did, for the run summary and bench/modes.py."""

    switches: int = 0
    sessions_rerouted: int = 0
    kv_moved: int = 0
    kv_tokens: int = 0
    reprefills: int = 0
    aborted_inflight: int = 0
    weight_loads: int = 0
    steps: int = 0
    groups_started: int = 0
    groups_done: int = 0
    switch_latency_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    step_pace_s: list[float] = field(default_factory=list)  # paced device time (0: none)
    switch_to: list[str] = field(default_factory=list)  # the role of each switch_latency_s
    load_s: list[float] = field(default_factory=list)  # decided weight loads, seconds
    cells_lost: int = 0
    cells_healed: int = 0
    step_retries: int = 0
    # the scheduling loop's own time: seconds and calls per decision kind, event kind and
    # look at the workers (everything else it waits for comes back as an event)
    loop_s: dict[str, float] = field(default_factory=dict)
    loop_n: dict[str, int] = field(default_factory=dict)
    # what a group's end costs off the loop: seconds per stage (``ended``: its rollout's
    # result, its sessions ended, the store flushed, processing asked for; ``processed``:
    # the processing result)
    off_loop_s: dict[str, float] = field(default_factory=dict)


class Executor(Healing):
    """Carries out decisions on cells, the gateway, engines and the DP group."""

    def __init__(
        self,
        cells: Cells,
        gateway: Any,
        store: Store,
        run_id: str,
        work: Work,
        engine: EngineSpec,
        *,
        version: int = 0,
        first_step: int = 0,
        drain_timeout_s: float = 60.0,
        step_timeout_s: float = 600.0,
        shuffle_buffer: int = 0,
        seed: int = 0,
        dp_host: str = "127.0.0.1",
        heal_timeout_s: float = 120.0,
        job_timeout_s: float = 3600.0,
        max_step_retries: int = 2,
        watch_s: float = 1.0,
        switch_s: float = 0.0,
        weight_load_s: float = 0.0,
    ):
        """``heal_timeout_s``: how long a lost cell may wait for a worker to take its place
        before the run stops; ``job_timeout_s``: bound on one rollout or processing task
        (from its start, or from the loss of a cell, whose tasks Dask reruns);
        ``max_step_retries``: retries of one step after losing members; ``watch_s``: how
        often the cluster's workers are looked at. ``switch_s``, ``weight_load_s``: paced
        device time of a role change and of a weight load (the simulator's costs): a decided
        load takes at least ``weight_load_s``, a move to train at least ``switch_s`` after its
        drain, a move to rollout at least ``switch_s + weight_load_s``."""
        self.cells = cells
        self.gateway = gateway
        self.store = store
        self.run_id = run_id
        self.work = work
        self.engine = engine
        self.addrs = sorted(cells.roles)
        self.version = version
        # the coordinator counts versions from 0 at every invocation (its lag admission
        # counts rollouts from there too); the store's checkpoints carry the run's versions,
        # which a resumed run continues: `run_version` and `coord_version` are the one
        # translation between the two, at this door
        self.version0 = version
        self.first_step = first_step  # a resumed run's step numbers continue
        self.drain_timeout_s = drain_timeout_s
        self.step_timeout_s = step_timeout_s
        self.heal_timeout_s = heal_timeout_s
        self.job_timeout_s = job_timeout_s
        self.max_step_retries = max_step_retries
        self.watch_s = watch_s
        self.switch_s, self.weight_load_s = switch_s, weight_load_s
        self._reroute: dict[int, dict[str, str]] = {}  # cell -> group id -> target cell id
        self._load_t: dict[int, float] = {}  # cell -> when its LoadWeights was applied
        self.membership = Membership(self.addrs, heal_timeout_s)  # shares self.addrs
        self.lost_addr: dict[int, str] = {}
        self._cell_locks = [threading.RLock() for _ in self.addrs]
        # never yet: time.monotonic() counts from boot on Linux, so 0.0 would be "watch_s
        # ago" only on a machine up longer than that (a fresh VM skipped its first looks)
        self._watched = -math.inf
        self._unrunnable_checked = -math.inf
        self._unrunnable: dict[int, Any] = {}  # group -> the task key last checked
        self._looking: Future | None = None  # a look at the workers under way (healing.py)
        self._look_again = False  # a forced look asked for while one was under way
        self._peek = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyre-exec-watch")
        self._no_worker: dict[int, float] = {}  # group -> since when no cell can run its task
        self._closing = threading.Event()
        self.shuffle_buffer = shuffle_buffer
        self.rng = random.Random(seed)
        self.stats = Stats()
        self.roles: list[str] = ["idle"] * len(self.addrs)
        self.engine_url: dict[int, str] = {}
        self.engine_version: dict[int, int] = {}
        self.routed: set[int] = set()  # cells whose engine the gateway routes to
        self.groups: dict[int, Group] = {}
        self.buffer: OrderedDict[int, Group] = OrderedDict()  # finished, untrained
        self.held: list[int] = []  # finished, in the shuffle buffer (not yet reported)
        self.next_index = 0
        self.generation = -1
        self.members: tuple[str, ...] = ()
        self.dp_left = False  # a member left the DP group since the last step
        self.step_jobs: list[Job] = []
        self.step_plan: StepPlan | None = None
        self.step_cells: tuple[int, ...] = ()
        self.step_t0 = 0.0
        self.step_token = 0  # member callbacks of an aborted attempt are ignored
        self.step_attempt = 0
        self.step_retry: tuple[float, str] | None = None  # (since, why) while aborted
        self.t0 = time.time()
        self.timeline: list[dict[str, Any]] = []  # role intervals and marks, for the report
        self._q: queue.Queue = queue.Queue()
        self._pool = ThreadPoolExecutor(  # an action waiting for its cell to heal holds one
            max_workers=4 + 2 * len(self.addrs), thread_name_prefix="gyre-exec"
        )
        # the parts of one action that run beside it (``together``): a pool of their own, so
        # an action never waits for a thread that another action waiting on its parts holds
        self._side = ThreadPoolExecutor(
            max_workers=2 + 2 * len(self.addrs), thread_name_prefix="gyre-exec-part"
        )
        # a group's end, off the loop: one thread each for rollout ends (in the order they
        # end: one flush at a time) and for processing results (in the order they end)
        self._ends = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyre-exec-end")
        self._results = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyre-exec-result")
        self.log = CellsLog(store, on_error=lambda exc: self._q.put(("error", "cells row", exc)))
        self._lock = threading.Lock()
        self._pins: dict[int, threading.Event] = {}  # cells held for an evaluation
        self._acting: set[int] = set()  # cells with a role change or weight load running
        self._dp_store, self.dp_port = host_store(dp_host, 0, timeout_s=step_timeout_s)
        self.dp_host = dp_host

    # -- naming and the record -------------------------------------------------------------
    def cell_id(self, i: int) -> str:
        return self.cells.cell_id(self.addrs[i])

    def record(
        self,
        i: int,
        event: str,
        role: str,
        reason: str = "",
        detail: str = "",
        costs: dict[str, float] | None = None,
    ) -> None:
        """One row of the ``cells`` dataset (and of the run's role timeline), written by the
        cells log (in order, off this thread); ``costs``: the action's measured seconds
        (``seconds``, ``wait_s``, ``drain_s``, ``park_s``, ``load_s``; storage/schemas.py)."""
        now = time.time()
        row = {
            "run_id": self.run_id,
            "cell_id": self.cell_id(i),
            "event": event,
            "role": role,
            "weight_version": self.engine_version.get(i, -1) if role == "rollout" else self.version,
            "t": now,
            "detail": detail,
            "reason": reason,
            **{k: round(v, 4) for k, v in (costs or {}).items()},
        }
        with self._lock:
            self.timeline.append({"cell": i, "event": event, "role": role, "t": now - self.t0})
        self.log.append(row)

    def run_version(self, v: int) -> int:
        """The run's (the store's) version of the coordinator's version ``v``."""
        return self.version0 + v

    def coord_version(self, v: int) -> int:
        """The coordinator's version of the run's version ``v`` (negative: from before this
        invocation, older than anything the coordinator knows)."""
        return v - self.version0

    # -- start and stop -----------------------------------------------------------------
    def start(self, roles: tuple[str, ...], reason: str) -> None:
        """Give every cell its initial role; rollout cells get an engine the gateway routes to."""
        if len(roles) != len(self.addrs):
            raise ExecutorError(f"{len(roles)} initial roles for {len(self.addrs)} cells")
        futures = []
        for i, role in enumerate(roles):
            futures.append(self._pool.submit(self._join, i, role, reason))
        for f in futures:
            f.result(timeout=600)

    def _join(self, i: int, role: str, reason: str) -> None:
        with self._cell_locks[i]:
            self._join_locked(i, role, reason)

    def _join_locked(self, i: int, role: str, reason: str) -> None:
        if role == "rollout":
            self.cells.set_role(self.addrs[i], "loading")
            self._serve(i)
        self.cells.set_role(self.addrs[i], role)
        self.roles[i] = role
        self.record(i, "join", role, reason, f"v{self.version}")

    def close(self) -> None:
        """Record every cell leaving; the pool stops (pending actions are bounded waits)."""
        self._closing.set()  # actions waiting for a lost cell to heal give up now
        for i, role in enumerate(self.roles):
            self.record(i, "leave", role, "run ended")
        for pool in (self._peek, self._ends, self._results, self._pool, self._side):
            pool.shutdown(wait=True, cancel_futures=True)
        # every row is in the store when the run reads it back; a store that is gone only
        # costs the rows (the run's own error says why), as the log's warning says
        if not self.log.close(timeout=60.0):
            log.warning("the cells log did not finish writing within 60 s")
        self._dp_store = None

    # -- the door -------------------------------------------------------------------------
    def apply(self, d: Decision, reason: str = "") -> None:
        """Carry out one decision (returns at once; completion comes back as an event)."""
        with self._timed(type(d).__name__):
            self._apply(d, reason)

    def _apply(self, d: Decision, reason: str) -> None:
        if isinstance(d, StartRollouts):
            for _ in range(d.n):
                self._start_group(d.cell)
        elif isinstance(d, Move):
            self._move(d, reason)
        elif isinstance(d, LoadWeights):
            v = self.run_version(d.version)
            self.record(d.cell, "decide", "rollout", reason, f"load v{v}")
            self._load_t[d.cell] = t = time.time()
            self._pool.submit(self._guard, ("loaded", d.cell), self._load, d.cell, v, True, t)
        elif isinstance(d, StartStep):
            self._start_step(d, reason)
        else:  # pragma: no cover - the Decision union is closed
            raise ExecutorError(f"unknown decision {d!r}")

    def events(self, timeout: float) -> list[Event]:
        """Events since the last call (waits up to ``timeout`` for the first one); looks
        at the cluster's workers first (losses, replacements, deadlines)."""
        with self._timed("watch"):
            out: list[Event] = self._watch()
        try:
            item = self._q.get(timeout=0 if out else timeout)
        except queue.Empty:
            return out
        while True:
            with self._timed(item[0]):
                out += self._handle(item)
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return out

    @contextmanager
    def _timed(self, what: str):
        """Seconds the scheduling loop spends in ``what`` (a decision carried out, an event
        handled, the look at the workers): ``Stats.loop_s``, for the run's summary."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.stats.loop_s[what] = self.stats.loop_s.get(what, 0.0) + time.monotonic() - t0
            self.stats.loop_n[what] = self.stats.loop_n.get(what, 0) + 1

    # -- rollouts -------------------------------------------------------------------------
    def _start_group(self, cell: int) -> None:
        idx = self.next_index
        self.next_index += 1
        g = Group(idx, cell, time.time(), deadline=time.monotonic() + self.job_timeout_s)
        self.groups[idx] = g
        g.job = self.work.rollout(idx, self.cell_id(cell))
        self.stats.groups_started += 1
        g.job.add_done_callback(lambda idx=idx: self._off_loop(self._ends, self._ended, idx))

    def in_flight(self, cell: int | None = None) -> list[int]:
        return sorted(
            i
            for i, g in self.groups.items()
            if g.phase in ("rollout", "process", "held") and (cell is None or g.cell == cell)
        )

    def process_addrs(self) -> tuple[str, ...]:
        """Where a finished group's processing goes: the rollout cells with no weight load
        decided or under way (all rollout cells if every one has: a load is short, a step
        or a role change is not), any of them (Dask takes the least occupied); none
        (anywhere) when no cell rolls out. A cell on its way between roles is never one: a
        drain, a park, a weight load are ``Client.run`` calls, not tasks, so Dask sees a
        cell busy with them as free, and a train cell as one task on its threads: unplaced,
        processing could wait behind any of them, or run beside a step. Not only the cells
        moved least often (elastic's core): at 8 cells the core is one cell, and every
        group's processing queued there (3.1 s a group live on hard_waves.yaml, 0.6-1.3 s
        in the fixed splits, BENCHMARKS.md)."""
        with self._lock:
            busy = set(self._acting) | set(self._load_t)
        lost = {i for i in range(len(self.addrs)) if self.membership.is_lost(i)}
        return tuple(self.addrs[i] for i in steady_cells(self.roles, busy, lost))

    def _off_loop(self, pool: ThreadPoolExecutor, fn: Callable[[int], None], idx: int) -> None:
        """A job's done callback (on Dask's or the submit thread): ``fn(idx)`` on ``pool``;
        an error in it reaches the loop, which raises it as it is (the run stops)."""

        def stage() -> None:
            t0 = time.monotonic()
            try:
                fn(idx)
            except BaseException as exc:
                self._q.put(("raise", exc))
            finally:
                with self._lock:
                    k = fn.__name__.strip("_")
                    off = self.stats.off_loop_s
                    off[k] = off.get(k, 0.0) + time.monotonic() - t0

        with suppress(RuntimeError):  # the executor is closing: nothing waits for it now
            pool.submit(stage)

    def _ended(self, idx: int) -> None:
        """Group ``idx``'s rollout task ended (off the loop, in end order): its sessions end
        at the gateway, its calls are flushed to the store, its processing is asked for;
        the loop hears of the group when its processing is done."""
        g = self.groups[idx]
        g.sessions = g.job.result()  # a failed task raises here: the run stops with it
        g.t_rollout = time.time()
        for h in g.sessions:  # no KV moves for sessions that are over
            self.gateway.end_session(h.session_id)
        self.gateway.flush()  # every answered call is in the store before processing
        self._mark_lost_sessions(g.sessions)
        job = self.work.process(g.index, g.sessions, self.version, workers=self.process_addrs())
        g.deadline = time.monotonic() + self.job_timeout_s
        g.phase, g.job = "process", job
        job.add_done_callback(lambda: self._off_loop(self._results, self._processed, idx))

    def _processed(self, idx: int) -> None:
        """Group ``idx``'s processing ended (off the loop): its result, to the loop."""
        self._q.put(("processed", idx, self.groups[idx].job.result()))

    def _handle(self, item: tuple) -> list[Event]:
        kind = item[0]
        if kind == "raise":
            raise item[1]  # a group's end failed off the loop: as the loop would have
        if kind == "processed":
            g = self.groups[item[1]]
            g.processed = item[2]
            g.phase, g.job, g.t_done = "held", None, time.time()
            self.held.append(g.index)
            self.stats.groups_done += 1
            return self._release()
        if kind == "moved":
            _, i, role, t_decided = item
            self.roles[i] = role
            secs = time.time() - t_decided
            self.stats.switch_latency_s.append(secs)
            self.stats.switch_to.append(role)
            return [MoveDone(i, seconds=secs)]  # measured: the policy's cost model learns it
        if kind == "loaded":
            _, i, v = item
            t = self._load_t.pop(i, None)
            secs = None if t is None else time.time() - t
            if secs is not None:
                self.stats.load_s.append(secs)
            return [WeightsLoaded(i, self.coord_version(v), seconds=secs)]
        if kind == "member":
            if item[1] != self.step_token or self.step_retry is not None:
                return []  # an aborted attempt's member
            return self._member_done()
        if kind == "workers":
            return self._seen(item[1])
        if kind == "healed":
            self.stats.cells_healed += 1
            return self._watch(force=True)
        if kind == "error":
            _, what, exc = item
            raise ExecutorError(f"{what} failed: {exc}") from exc
        raise ExecutorError(f"unknown executor event {item!r}")  # pragma: no cover

    def _release(self) -> list[Event]:
        """Finished groups go to the coordinator's water level; with a shuffle buffer of
        ``S`` they are held back and released in random order once more than ``S`` wait
        (or when nothing else is running), which mixes sessions and time in the steps at
        a bounded cost in lag (measured in ``ledger``)."""
        out: list[Event] = []
        running = any(g.phase in ("rollout", "process") for g in self.groups.values())
        while self.held and (len(self.held) > self.shuffle_buffer or not running):
            k = self.rng.randrange(len(self.held)) if self.shuffle_buffer else 0
            g = self.groups[self.held.pop(k)]
            g.phase = "buffered"
            self.buffer[g.index] = g
            v = getattr(g.processed, "version_min", -1)  # -1: unknown
            out.append(RolloutFinished(g.cell, g.index, self.coord_version(v) if v >= 0 else None))
        return out

    # -- evaluation pins (flows/evaluation.py) --------------------------------------------
    def pin(self, i: int) -> int | None:
        """Hold rollout cell ``i`` on the weights it serves, for a held-out evaluation: a
        role change or weight load decided for it waits (on the action pool) until
        ``unpin``. Returns the version it serves, or None (and pins nothing) when it is not
        serving or has a role change or load under way."""
        with self._lock:
            if i in self._acting or i in self._pins or i not in self.routed:
                return None
            if i not in self.engine_version:
                return None
            self._pins[i] = threading.Event()
            return self.engine_version[i]

    def unpin(self, i: int) -> None:
        with self._lock:
            ev = self._pins.pop(i, None)
        if ev is not None:
            ev.set()

    @contextmanager
    def _acting_on(self, i: int):
        """Wait while cell ``i`` is pinned (bounded by ``step_timeout_s``), then mark it
        as changing until the action ends."""
        while True:
            with self._lock:
                ev = self._pins.get(i)
                if ev is None:
                    self._acting.add(i)
                    break
            deadline = time.monotonic() + self.step_timeout_s
            while not ev.is_set() and not self._closing.is_set():
                if time.monotonic() > deadline:
                    log.warning(
                        "cell %s pinned past %.0fs: unpinned", self.cell_id(i), self.step_timeout_s
                    )
                    self.unpin(i)
                    break
                ev.wait(0.5)
            if self._closing.is_set():
                self.unpin(i)
        try:
            yield
        finally:
            with self._lock:
                self._acting.discard(i)

    # -- role changes ------------------------------------------------------------------
    def _move(self, d: Move, reason: str) -> None:
        i = d.cell
        t = time.time()
        self.stats.switches += 1
        # mirror the coordinator's books: the cell's groups now belong to the reroute targets
        # and the gateway moves each group's sessions to that cell (not the least-loaded one)
        targets = [c for c, n in d.reroute for _ in range(n)]
        gid = getattr(self.work, "group_id", lambda idx: f"g{idx}")
        route = {}
        for idx, tgt in zip(self.in_flight(i), targets, strict=False):
            self.groups[idx].cell = tgt
            route[gid(idx)] = self.cell_id(tgt)
        self._reroute[i] = route
        transit = "draining" if d.to == "train" else "loading"
        self.roles[i] = transit
        self.record(i, "decide", transit, reason, f"to {d.to}")
        fn = self._to_train if d.to == "train" else self._to_rollout
        self._pool.submit(self._guard, ("move", i), fn, i, t, reason)

    def _to_train(self, i: int, t_decided: float, reason: str) -> None:
        """Rollout -> train. The gateway's withdrawal does not wait for the cell's Dask
        role (no rollout task takes the resource ``draining`` removes; harness slots stay),
        and the ``train`` role does not wait for the engine to park: no training work is
        submitted to the cell before its ``MoveDone``, which comes after both."""
        addr = self.addrs[i]
        costs = {"wait_s": time.time() - t_decided}
        log.info("cell %s draining (%.2fs after the decision)", self.cell_id(i), costs["wait_s"])
        out = together(
            self._side,
            lambda: self._withdraw(i, costs),
            lambda: self.cells.set_role(addr, "draining"),
        )
        log.info("cell %s withdrawn: %s", self.cell_id(i), out)
        t_drained = time.monotonic()
        together(
            self._side, lambda: self._park(i, costs), lambda: self.cells.set_role(addr, "train")
        )
        _pace(t_drained, self.switch_s)
        detail = ", ".join(f"{k}={v}" for k, v in out.items() if k != "cell_id")
        costs["seconds"] = time.time() - t_decided
        self.record(i, "role", "train", reason, detail, costs)
        self._q.put(("moved", i, "train", t_decided))

    def _withdraw(self, i: int, costs: dict[str, float]) -> dict[str, Any]:
        """The gateway stops routing to cell ``i``: in-flight calls finish (bounded), then
        each session moves, with its KV, to its group's reroute target."""
        if i not in self.routed:
            return {}
        t0 = time.monotonic()
        out = self.gateway.remove_engine(
            self.cell_id(i), drain_timeout=self.drain_timeout_s, targets=self._reroute.pop(i, {})
        )
        costs["drain_s"] = time.monotonic() - t0
        self.routed.discard(i)
        self.stats.sessions_rerouted += int(out.get("sessions_moved", 0))
        self.stats.kv_moved += int(out.get("kv_moves", 0))
        self.stats.kv_tokens += int(out.get("kv_tokens", 0))
        self.stats.reprefills += int(out.get("reprefills", 0))
        self.stats.aborted_inflight += int(out.get("aborted_inflight", 0))
        return out

    def _park(self, i: int, costs: dict[str, float]) -> None:
        if i in self.engine_url:
            t0 = time.monotonic()
            self.cells.run_on(self.addrs[i], park_engine)
            costs["park_s"] = time.monotonic() - t0

    def _to_rollout(self, i: int, t_decided: float, reason: str) -> None:
        """Train -> rollout (between steps). The engine's start and weight load, the cell's
        leaving its DP group and its ``loading`` role do not wait for each other (no train
        task is submitted to a cell on its way out; the engine is the cell's own); the
        gateway routes to it once its weights are loaded, beside its ``rollout`` role."""
        addr = self.addrs[i]
        costs = {"wait_s": time.time() - t_decided}
        t0 = time.monotonic()
        self.dp_left = True
        together(
            self._side,
            lambda: self._ready(i, costs),
            lambda: self.cells.set_role(addr, "loading"),
            lambda: self.cells.run_on(addr, _leave_dp),
        )
        _pace(t0 + self.switch_s + self.weight_load_s, 0.0)
        together(self._side, lambda: self._route(i), lambda: self.cells.set_role(addr, "rollout"))
        costs["seconds"] = time.time() - t_decided
        self.record(i, "role", "rollout", reason, f"serving v{self.engine_version[i]}", costs)
        self._q.put(("moved", i, "rollout", t_decided))

    def _serve(self, i: int, pace_until: float = 0.0) -> None:
        """Start (or unpark) the cell's engine with the newest weights, then route to it
        (not before ``pace_until``, monotonic: a paced role change)."""
        self._ready(i, {})
        _pace(pace_until, 0.0)
        self._route(i)

    def _route(self, i: int) -> None:
        self.gateway.add_engine(self.cell_id(i), self.engine_url[i])
        self.routed.add(i)

    def _ready(self, i: int, costs: dict[str, float]) -> None:
        """The cell's engine started (once; a parked one is kept) and serving the newest
        weights; ``costs`` gets ``start_s`` and ``load_s`` (seconds)."""
        addr, e = self.addrs[i], self.engine
        if i not in self.engine_url:
            t0 = time.monotonic()
            self.engine_url[i] = self.cells.run_on(
                addr,
                start_engine,
                e.model_dir,
                cell_id=self.cell_id(i),
                weight_version=0,
                max_batch_size=e.max_batch_size,
                kv_cache_tokens=e.kv_cache_tokens,
                audit_dir=e.audit_dir,
                decode_step_s=e.decode_step_s,
                prefill_tokens_per_s=e.prefill_tokens_per_s,
                store=self.store,  # model_dir is on the run's host; other hosts fetch v0
                run_id=self.run_id,
            )
            costs["start_s"] = time.monotonic() - t0
            self.engine_version[i] = -1  # a parked engine may hold another run's weights
        for _ in range(3):  # a step may publish while we load: the cell joins with the newest
            v = self.version
            if self.engine_version.get(i) == v:
                break
            self._load(i, v, report=False, costs=costs)

    def _load(
        self,
        i: int,
        version: int,
        report: bool,
        t_decided: float | None = None,
        costs: dict[str, float] | None = None,
    ) -> None:
        """Cell ``i``'s engine loads checkpoint ``version``; ``report``: a decided load
        (``LoadWeights`` at ``t_decided``): recorded with its costs and answered with
        ``WeightsLoaded``. ``costs['load_s']`` adds the load's own seconds."""
        costs = {} if costs is None else costs
        if t_decided is not None:
            costs["wait_s"] = time.time() - t_decided  # the pin, the cell's lock, the pool
        if report and self.engine_version.get(i, -1) >= version:
            # a healed cell already serves these weights (or newer): never go back
            self._q.put(("loaded", i, self.engine_version[i]))
            return
        t0 = time.monotonic()
        res = self.cells.run_on(self.addrs[i], load_weights, self.store, self.run_id, version)
        costs["load_s"] = costs.get("load_s", 0.0) + time.monotonic() - t0
        if report:
            _pace(t0, self.weight_load_s)
        if not res.get("success", False):
            raise ExecutorError(f"cell {self.cell_id(i)} could not load v{version}: {res}")
        self.engine_version[i] = version
        self.stats.weight_loads += 1
        if report:
            if t_decided is not None:
                costs["seconds"] = time.time() - t_decided
            self.record(i, "load_weights", "rollout", "", f"v{version}", costs)
            self._q.put(("loaded", i, version))

    # -- training -----------------------------------------------------------------------
    def _pick(self, d: StartStep) -> list[Group]:
        """The buffered groups this step trains: those the coordinator names, else the
        next ones in its order (start index, or release order)."""
        if d.rollouts:
            return [self.buffer[i] for i in d.rollouts]
        cands = sorted(self.buffer) if d.order == "index" else list(self.buffer)
        return [self.buffer[i] for i in cands[: d.samples]]

    def _start_step(self, d: StartStep, reason: str) -> None:
        if self.step_jobs:
            raise ExecutorError("a step was started while another runs (one at a time)")
        picked = self._pick(d)
        if len(picked) != d.samples:
            raise ExecutorError(
                f"step needs {d.samples} finished groups, the buffer holds {len(self.buffer)}"
            )
        members = tuple(self.cell_id(i) for i in d.cells)
        if members != self.members or self.dp_left:
            # a new generation whenever the group changed: members joined, or some left
            # (a cell that goes to rollout leaves its process group) even if they are back
            self.generation += 1
            self.members, self.dp_left = members, False
        plan = StepPlan(
            step=self.first_step + self.stats.steps,
            version=self.version,
            generation=self.generation,
            host=self.dp_host,
            port=self.dp_port,
            members=members,
            groups=tuple(g.index for g in picked),
            segments=tuple(
                g.processed.samples_segment for g in picked if g.processed.samples_segment
            ),
            shuffle_seed=self.rng.randrange(1 << 30),
            workers=tuple(self.addrs[i] for i in d.cells),
        )
        pace = getattr(self.work, "step_pace_s", None)  # paced: the simulator's step time
        if pace is not None:
            plan = replace(plan, pace_s=pace(plan))
        for g in picked:
            del self.buffer[g.index]
            g.phase = "trained"
        for i in d.cells:
            self.record(i, "step", "train", reason, f"step {plan.step} gen {plan.generation}")
        self.step_cells, self.step_t0, self.step_attempt = tuple(d.cells), time.time(), 0
        if lost := [i for i in d.cells if self.membership.is_lost(i)]:
            # a member cell was lost between steps and is healing: the coordinator booked
            # the step with it, so the step waits for it as an aborted attempt does (its
            # retry: a new generation on the healed worker, once its preload is in), not
            # at a rendezvous whose dead member never comes
            self.step_plan, self.step_jobs = plan, []
            self.step_retry = (time.monotonic(), f"member cell(s) {lost} lost before the step")
            log.warning("step %d waits for member cell(s) %s to heal", plan.step, lost)
            return
        self._submit_step(plan)

    def _submit_step(self, plan: StepPlan) -> None:
        self.step_plan = plan
        self.step_token += 1
        token = self.step_token
        self.step_jobs = self.work.step(plan)
        for j in self.step_jobs:
            j.add_done_callback(lambda token=token: self._q.put(("member", token)))

    def _member_done(self) -> list[Event]:
        """A member ended: the step is done when all are; a failed member stops the run
        now (not at the DP timeout), unless a member's cell was lost: then it is retried."""
        for j in self.step_jobs:
            if not j.done():
                continue
            try:
                j.result()
            except Exception as exc:
                if self._step_cell_lost(grace_s=10.0):
                    self._abort_step(f"a member failed after a member cell was lost: {exc}")
                    return []
                raise ExecutorError(f"step {self.step_plan.step}: a member failed: {exc}") from exc
        if self.step_jobs and all(j.done() for j in self.step_jobs):
            return self._finish_step()
        return []

    def _finish_step(self, results: list[Any] | None = None) -> list[Event]:
        jobs, plan = self.step_jobs, self.step_plan
        self.step_jobs, self.step_plan = [], None
        if results is None:
            results = [j.result() for j in jobs]  # a failed member raises: the run stops
        versions = {r.weight_version for r in results}
        if versions != {plan.version + 1}:
            raise ExecutorError(f"step {plan.step}: members ended at versions {versions}")
        self.version = plan.version + 1
        secs = time.time() - self.step_t0  # its start to its last member's end, retries too
        detail = f"step {plan.step} -> v{self.version}"
        for k, i in enumerate(self.step_cells):  # member k's result (a healed step: one)
            r = results[k] if k < len(results) else None
            self.record(i, "step_done", "train", "", detail, step_costs(r, self.step_t0, secs))
        self.stats.steps += 1
        self.stats.step_s.append(secs)
        self.stats.step_pace_s.append(plan.pace_s)
        self.last_step = results[0]
        return [StepFinished(self.step_cells, seconds=self.stats.step_s[-1])]

    def engine_counters(self) -> dict[str, dict[str, Any]]:
        """Each engine's counters (paced device time, decode steps), by cell id."""
        out = {}
        for i in sorted(self.engine_url):
            try:
                out[self.cell_id(i)] = self.cells.run_on(self.addrs[i], engine_stats)
            except Exception as exc:  # best effort, for the report
                out[self.cell_id(i)] = {"error": str(exc)}
        return out


def step_costs(result: Any, t0: float, seconds: float) -> dict[str, float]:
    """A member's ``step_done`` costs: the step's ``seconds`` and the member's own parts
    (``TrainedStep.costs``): ``dispatch_s`` from the step's start (``t0``, wall clock) to
    the member's (its task submitted, scheduled, started: clock skew between hosts shows
    here, so never below 0), ``form_s``, ``sync_s``, ``train_s``, ``commit_s`` (rank 0)."""
    own = getattr(result, "costs", None) or {}
    out = {"seconds": seconds}
    if "begin_t" in own:
        out["dispatch_s"] = max(0.0, own["begin_t"] - t0)
    out |= {k: own[k] for k in ("form_s", "sync_s", "train_s", "commit_s") if k in own}
    return out


def steady_cells(roles: list[str], busy: set[int], lost: set[int]) -> tuple[int, ...]:
    """The cells ``Executor.process_addrs`` places processing on: the rollout cells not
    lost with no action (``busy``: a weight load decided or under way), or all the rollout
    cells not lost if every one is busy."""
    rollout = [i for i, role in enumerate(roles) if role == "rollout" and i not in lost]
    return tuple(i for i in rollout if i not in busy) or tuple(rollout)


def together(pool: ThreadPoolExecutor, main: Callable[[], Any], *side: Callable[[], Any]) -> Any:
    """Run ``side`` on ``pool`` while ``main`` runs on this thread; return ``main``'s result
    once every part has ended (the first error of any is raised, after all have ended): the
    parts of one role change that do not wait for each other."""
    futs = [pool.submit(f) for f in side]
    try:
        out = main()
    finally:
        for f in futs:  # no part outlives its action, whatever happened
            f.exception()
    for f in futs:
        f.result()
    return out


def _pace(started: float, seconds: float) -> None:
    """Sleep until ``seconds`` after ``started`` (monotonic): a paced device cost."""
    left = started + seconds - time.monotonic()
    if left > 0:
        time.sleep(left)


def _leave_dp(plugin: Any) -> None:
    """A cell that leaves training leaves its process group (the next step forms a new one)."""
    if plugin.dp is not None:
        plugin.dp.close()
        plugin.dp = None
