"""Discrete-event simulator of the xLong workload, driving any scheduling mode.

The executor side of policy-vs-mechanism: it owns the clock (a heap of
events), the sessions and the costs, feeds events to a
:class:`~tasks.sched.coordinator.Coordinator` and carries out the decisions it gets
back. The same policy objects will drive real Dask cells.

Workload model (all in :class:`Workload`):

- an unbounded stream of rollouts; rollout ``i`` runs ``durations[i]`` seconds
  of wall time while it holds a slot on a rollout cell (log-normal: minutes to
  hours), cut at ``timeout_s`` (partial scoring: a timed-out rollout still
  yields its sample). Rollout ``i`` has the same duration in every mode.
- a rollout cell serves at most ``cap`` sessions at once (engine concurrency).
- a session makes a model call every ``call_s`` seconds; call ends are its
  boundaries. A session on a draining cell moves at its next boundary and then
  pauses ``migrate_s`` (KV move) or ``reprefill_s`` (no KV move).
- loading weights into a rollout cell pauses its sessions ``weight_load_s``.
- a role change costs ``switch_s`` (plus ``weight_load_s`` into rollout).
- an optimizer step on ``b`` samples over ``m`` cells takes
  ``b * train_s_per_sample / m + dp_sync_s * m`` (dynamic-membership DP).

Metrics: samples trained per hour, cell-time split into busy / idle /
switching (a rollout cell is busy in proportion to its occupied slots), mean
and max staleness (train version minus the version a rollout started with, and
minus the version of its last tokens), role switches, sessions broken.
Deterministic for a seed. Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from tasks.sched.coordinator import (
    Coordinator,
    Decision,
    LoadWeights,
    Move,
    MoveDone,
    Policy,
    RolloutFinished,
    StartRollouts,
    StartStep,
    StepFinished,
    Tick,
    WeightsLoaded,
)
from tasks.sched.waterlevel import dp_step_seconds


@dataclass(frozen=True)
class Workload:
    """The simulated xLong workload and its costs (seconds)."""

    cells: int = 8
    cap: int = 4
    batch: int = 32
    median_s: float = 1800.0
    sigma: float = 1.0
    timeout_s: float = 4 * 3600.0
    call_s: float = 60.0
    train_s_per_sample: float = 60.0
    dp_sync_s: float = 2.0
    weight_load_s: float = 30.0
    switch_s: float = 60.0
    migrate_s: float = 5.0
    reprefill_s: float = 60.0
    kv_move: bool = True
    horizon_s: float = 48 * 3600.0
    tick_s: float = 15.0


_CHUNK = 4096


class _Durations:
    """Rollout i's duration, the same sequence for every mode (one seeded stream)."""

    def __init__(self, w: Workload, seed: int) -> None:
        self._rng = np.random.default_rng(seed)
        self._mu = math.log(w.median_s)
        self._sigma = w.sigma
        self._timeout = w.timeout_s
        self._vals: list[float] = []

    def __getitem__(self, i: int) -> float:
        while i >= len(self._vals):
            draw = self._rng.lognormal(self._mu, self._sigma, _CHUNK)
            self._vals.extend(np.minimum(draw, self._timeout).tolist())
        return self._vals[i]


# per-cell accounting categories
_RB, _RI, _TB, _TI, _SW = range(5)


class Simulator:
    """One run of one policy on one seeded workload; call :meth:`run`."""

    def __init__(self, policy: Policy, w: Workload, seed: int = 0) -> None:
        self.w = w
        self.policy = policy
        self.coord = Coordinator(policy, w.cells, w.cap)
        self.dur = _Durations(w, seed)
        self.now = 0.0
        self._heap: list[tuple[float, int, str, tuple]] = []
        self._seq = 0
        n = w.cells
        # physical view of the cells (the coordinator holds the logical one)
        self.role = [c.role for c in self.coord.state().cells]
        self.loading = [False] * n
        self.load_until = [0.0] * n
        self.stepping = [False] * n
        self.phys = [0] * n  # sessions physically on the cell
        self.version_on = [0] * n  # weights loaded on the cell
        self.acc = [0.0] * 5
        self.rate = [0.0] * 5
        for c in range(n):
            self._add(c, +1)
        # sessions: index -> [phys cell, logical cell, end, start_version, epoch]
        self.sess: dict[int, list] = {}
        self.on_cell: list[set[int]] = [set() for _ in range(n)]
        self.unfinished: dict[int, tuple[int, int]] = {}  # finished, untrained: idx -> (v0, v1)
        self.finish_order: deque[int] = deque()
        self.next_index_to_train = 0
        self.stats = {
            "started": 0,
            "finished": 0,
            "timed_out": 0,
            "trained": 0,
            "steps": 0,
            "switches": 0,
            "broken": 0,
            "migrations": 0,
            "weight_loads": 0,
        }
        self.stale_start: list[int] = []
        self.stale_end: list[int] = []
        self.last_t = 0.0

    # -- accounting
    def _cat(self, c: int) -> tuple[int, float]:
        r = self.role[c]
        if r in ("draining", "loading") or (r == "rollout" and self.loading[c]):
            return _SW, 1.0
        if r == "rollout":
            return _RB, min(self.phys[c], self.w.cap) / self.w.cap
        return (_TB, 1.0) if self.stepping[c] else (_TI, 1.0)

    def _add(self, c: int, sign: int) -> None:
        k, f = self._cat(c)
        if k == _RB:
            self.rate[_RB] += sign * f
            self.rate[_RI] += sign * (1.0 - f)
        else:
            self.rate[k] += sign * f

    def _change(self, c: int, attr: str, value) -> None:
        self._add(c, -1)
        getattr(self, attr)[c] = value
        self._add(c, +1)

    def _advance(self, t: float) -> None:
        assert t >= self.now - 1e-9, "time must not run backwards"
        dt = t - self.now
        for k in range(5):
            self.acc[k] += dt * self.rate[k]
        self.now = t

    # -- events
    def _push(self, t: float, kind: str, payload: tuple) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def run(self) -> dict[str, float]:
        w = self.w
        self._push(0.0, "tick", ())
        while self._heap:
            t, _, kind, p = heapq.heappop(self._heap)
            if t > w.horizon_s:
                break
            self._advance(t)
            if kind == "tick":
                for d in self.coord.handle(Tick(t)):
                    self._execute(d)
                self._push(t + w.tick_s, "tick", ())
            elif kind == "done":
                self._finish(*p)
            elif kind == "arrive":
                self._arrive(*p)
            elif kind == "move_done":
                self._move_done(*p)
            elif kind == "loaded":
                self._loaded(*p)
            elif kind == "step_done":
                self._step_done(*p)
        self._advance(max(self.now, w.horizon_s))
        return self.metrics()

    def _finish(self, idx: int, epoch: int) -> None:
        s = self.sess.get(idx)
        if s is None or s[4] != epoch:
            return  # superseded by a pause or a migration
        phys, logical, _, v0, _ = s
        del self.sess[idx]
        self.on_cell[phys].discard(idx)
        self._change(phys, "phys", self.phys[phys] - 1)
        self.stats["finished"] += 1
        if self.dur[idx] >= self.w.timeout_s:
            self.stats["timed_out"] += 1
        self.unfinished[idx] = (v0, self.version_on[phys])
        self.finish_order.append(idx)
        self.coord.handle(RolloutFinished(logical, idx))

    def _pause_all(self, c: int, secs: float) -> None:
        for idx in self.on_cell[c]:
            s = self.sess[idx]
            s[2] += secs
            s[4] += 1
            self._push(s[2], "done", (idx, s[4]))

    def _execute(self, d: Decision) -> None:
        w = self.w
        if isinstance(d, StartRollouts):
            v = self.version_on[d.cell]
            for _ in range(d.n):
                idx = self.stats["started"]
                self.stats["started"] += 1
                end = self.now + self.dur[idx]
                self.sess[idx] = [d.cell, d.cell, end, v, 0]
                self.on_cell[d.cell].add(idx)
                self._push(end, "done", (idx, 0))
            self._change(d.cell, "phys", self.phys[d.cell] + d.n)
        elif isinstance(d, LoadWeights):
            self.stats["weight_loads"] += 1
            self._change(d.cell, "loading", True)
            self.load_until[d.cell] = self.now + w.weight_load_s
            self._pause_all(d.cell, w.weight_load_s)
            self._push(self.now + w.weight_load_s, "loaded", (d.cell, d.version))
        elif isinstance(d, StartStep):
            for c in d.cells:
                self._change(c, "stepping", True)
            dt = dp_step_seconds(d.samples, len(d.cells), w.train_s_per_sample, w.dp_sync_s)
            self._take(d.samples, d.order)
            self._push(self.now + dt, "step_done", (d.cells, d.samples))
        elif isinstance(d, Move):
            self.stats["switches"] += 1
            src = d.cell
            self._change(src, "role", "draining" if d.to == "train" else "loading")
            if d.to == "rollout":
                self._push(self.now + w.switch_s + w.weight_load_s, "move_done", (src,))
                return
            targets = [t for t, n in d.reroute for _ in range(n)]
            sessions = sorted(self.on_cell[src])
            assert len(targets) >= len(sessions), "reroute must cover every live session"
            drained = self.now
            for idx, tgt in zip(sessions, targets, strict=False):
                s = self.sess[idx]
                s[1] = tgt
                since = self.now - (s[2] - self.dur[idx])  # elapsed (pauses included)
                k = math.ceil(since / w.call_s - 1e-9)
                boundary = self.now + max(0.0, k * w.call_s - since)
                if boundary >= s[2]:
                    drained = max(drained, s[2])  # finishes here before its next call
                    continue
                drained = max(drained, boundary)
                self._push(boundary, "arrive", (idx, tgt, s[4]))
            self._push(drained + w.switch_s, "move_done", (src,))

    def _arrive(self, idx: int, tgt: int, epoch: int) -> None:
        s = self.sess.get(idx)
        if s is None:
            return
        src = s[0]
        self.on_cell[src].discard(idx)
        self._change(src, "phys", self.phys[src] - 1)
        if self.role[tgt] != "rollout" or self.phys[tgt] >= self.w.cap:
            self.stats["broken"] += 1  # nowhere to run: the session is lost
            del self.sess[idx]
            self.unfinished[idx] = (s[3], s[3])  # counted (as broken), keeps the books even
            self.finish_order.append(idx)
            self.coord.handle(RolloutFinished(s[1], idx))
            return
        cost = self.w.migrate_s if self.w.kv_move else self.w.reprefill_s
        if self.loading[tgt]:  # arrives while the target loads weights: waits for it too
            cost += max(0.0, self.load_until[tgt] - self.now)
        s[0] = tgt
        s[2] += cost
        s[4] += 1
        self.on_cell[tgt].add(idx)
        self._change(tgt, "phys", self.phys[tgt] + 1)
        self.stats["migrations"] += 1
        self._push(s[2], "done", (idx, s[4]))

    def _move_done(self, c: int) -> None:
        if self.on_cell[c]:  # a session still here when the cell changes role
            self.stats["broken"] += len(self.on_cell[c])
        target = self.coord.cell(c).target
        assert target is not None
        self._change(c, "role", target)
        self.coord.handle(MoveDone(c))
        self.version_on[c] = self.coord.version

    def _loaded(self, c: int, v: int) -> None:
        self._change(c, "loading", False)
        self.version_on[c] = max(self.version_on[c], v)
        self.coord.handle(WeightsLoaded(c, v))

    def _step_done(self, cells: tuple[int, ...], samples: int) -> None:
        for c in cells:
            self._change(c, "stepping", False)
        self.stats["steps"] += 1
        self.stats["trained"] += samples
        self.coord.handle(StepFinished(cells))
        for c in cells:
            self.version_on[c] = self.coord.version

    def _take(self, n: int, order: str) -> None:
        """Take ``n`` finished samples off the buffer and record their staleness."""
        v = self.coord.version
        for _ in range(n):
            if order == "index":
                idx = self.next_index_to_train
                self.next_index_to_train += 1
            else:
                idx = self.finish_order.popleft()
                while idx not in self.unfinished:
                    idx = self.finish_order.popleft()
            v0, v1 = self.unfinished.pop(idx)
            self.stale_start.append(v - v0)
            self.stale_end.append(v - v1)

    def metrics(self) -> dict[str, float]:
        hours = self.w.horizon_s / 3600.0
        total = self.w.cells * self.w.horizon_s
        rb, ri, tb, ti, sw = self.acc
        st = self.stats

        def frac(x: float, y: float) -> float:
            return x / y if y > 0 else 0.0

        return {
            "samples_per_hour": st["trained"] / hours,
            "samples_trained": float(st["trained"]),
            "steps": float(st["steps"]),
            "rollouts_started": float(st["started"]),
            "rollouts_finished": float(st["finished"]),
            "rollouts_in_flight": float(len(self.sess)),
            "rollouts_timed_out": float(st["timed_out"]),
            "idle_fraction": frac(ri + ti, total),
            "idle_fraction_rollout": frac(ri, rb + ri),
            "idle_fraction_train": frac(ti, tb + ti),
            "busy_fraction": frac(rb + tb, total),
            "switching_fraction": frac(sw, total),
            "cell_seconds": rb + ri + tb + ti + sw,
            "staleness_mean": float(np.mean(self.stale_start)) if self.stale_start else 0.0,
            "staleness_max": float(max(self.stale_start, default=0)),
            "staleness_last_tokens_mean": float(np.mean(self.stale_end)) if self.stale_end else 0.0,
            "staleness_last_tokens_max": float(max(self.stale_end, default=0)),
            "role_switches": float(st["switches"]),
            "sessions_broken": float(st["broken"]),
            "migrations": float(st["migrations"]),
            "weight_loads": float(st["weight_loads"]),
        }


def simulate(policy: Policy, workload: Workload, seed: int = 0) -> dict[str, float]:
    """Run ``policy`` on the seeded ``workload``; returns flat metrics."""
    return Simulator(policy, workload, seed).run()


def default_policies(w: Workload, async_rollout_frac: float = 0.75, core_frac: float = 0.25):
    """The three modes configured for ``w`` the same way the bench does."""
    from tasks.sched.modes import Async, Colocate, Elastic, core_cells
    from tasks.sched.waterlevel import Marks

    k = max(1, min(w.cells - 1, round(async_rollout_frac * w.cells)))
    return {
        "colocate": Colocate(batch=w.batch),
        "async": Async(batch=w.batch, rollout_cells=k),
        "elastic": Elastic(
            batch=w.batch,
            marks=Marks(low=0.5 * w.batch, high=2.0 * w.batch),
            core=core_cells(w.cells, core_frac),
            train_s_per_sample=w.train_s_per_sample,
            dp_sync_s=w.dp_sync_s,
            move_step=max(1, w.cells // 16),
        ),
    }


def workload_dict(w: Workload) -> dict[str, float]:
    return {k: float(v) for k, v in asdict(w).items()}
