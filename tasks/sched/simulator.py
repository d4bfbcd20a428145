"""Discrete-event simulator of the xLong workload, driving any scheduling mode.

The executor side of policy-vs-mechanism: it owns the clock (a heap of
events), the sessions and the costs, feeds events to a
:class:`~tasks.sched.coordinator.Coordinator` and carries out the decisions it
gets back. The same policy objects will drive real Dask cells.

The workload (:class:`~tasks.sched.workload.Workload`): a run is ``steps``
optimizer steps of ``batch`` samples; rollout ``i`` (in start order) generates
for ``durations[i]`` seconds while it holds a slot on a rollout cell, the same
in every mode; a cell serves at most ``cap`` sessions.

Mechanics, as in the real system:

- a session makes a model call every ``call_s`` seconds of generation; call
  ends are its boundaries. A session on a draining cell moves at its next
  boundary and then pauses ``migrate_s`` (KV move) or ``reprefill_s``, plus
  what is left of its new cell's weight load.
- loading weights into a rollout cell pauses its sessions ``weight_load_s``;
  after it they generate with the new version.
- a role change costs ``switch_s`` (plus ``weight_load_s`` into rollout) once
  the cell has drained.
- a rollout's sample reaches the water level ``finish_delay_s`` plus
  ``process_s`` after its last token (its slot stays booked meanwhile), and
  every step costs ``step_overhead_s`` on top: the executor's own costs, 0
  unless a live bench measured them (bench/modes.py). Each is a log-normal
  draw around its mean where its ``*_sigma`` is set (the same draws in every
  mode: rollout ``i``'s delay, step ``k``'s overhead), exactly the mean where
  it is 0; a step whose members differ from the last step's pays
  ``regroup_s`` more (a new DP generation: only a mode that changes its
  members pays it).
- an optimizer step on ``b`` samples over ``m`` cells takes
  ``b * train_s_per_sample / m + dp_sync_s * m`` (dynamic-membership DP); with
  ``train_follows_length`` the ``b * train_s_per_sample`` is the sum of the
  step's samples' :meth:`~tasks.sched.workload.Workload.train_cost` (each in
  proportion to the generation time of its rollout).

Policy lag is measured on tokens: a session's generation time is cut into
segments by weight version (tokens are generated at a steady rate, so time
weights tokens); a step from weights ``w`` trains a segment of version ``u``
at lag ``w - u``. Reported: the token-weighted mean and the max over every
trained token, in every mode.

Metrics: whole-run rate (``steps * batch`` over the time to the last step's
end) and steady rate (batch over the mean gap between step starts after the
first quarter of the run), cell-time split into busy / idle / switching (a
rollout cell is busy in proportion to its occupied slots), lag, role switches
(per cell-day, and the most by one cell; *wasted*: both moves of a cell
recruited to training and sent back without joining a step), sessions broken.
Deterministic for a seed. Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import heapq
import math

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
from tasks.sched.workload import Durations, Spread, Workload

__all__ = ["Simulator", "Workload", "simulate"]


class _Sess:
    """A live session: where it is, how far it got, the versions of its tokens."""

    __slots__ = ("acc", "dur", "epoch", "gen", "idx", "logical", "phys", "run_from", "ver", "vmin")

    def __init__(self, idx: int, cell: int, dur: float, now: float, ver: int) -> None:
        self.idx = idx
        self.phys = cell  # the cell it runs on
        self.logical = cell  # the cell the coordinator books it on (its reroute target)
        self.dur = dur  # generation seconds in all
        self.gen = 0.0  # generation seconds before run_from
        self.run_from = now  # when the current segment starts (after any pause)
        self.ver = ver  # weight version of the current segment
        self.acc = 0.0  # sum of version x seconds over closed segments
        self.vmin = ver  # oldest version among its tokens
        self.epoch = 0  # bumped on every pause: stale "done" events are dropped

    def close(self, t: float) -> None:
        """Close the running segment at ``t`` (no-op while paused)."""
        seg = t - self.run_from
        if seg > 0:
            self.acc += self.ver * seg
            self.gen += seg
            self.vmin = min(self.vmin, self.ver)
            self.run_from = t

    def progress(self, t: float) -> float:
        return self.gen + max(0.0, t - self.run_from)

    def end(self) -> float:
        return self.run_from + max(0.0, self.dur - self.gen)


# per-cell accounting categories
_RB, _RI, _TB, _TI, _SW = range(5)


class Simulator:
    """One run of one policy on one seeded workload; call :meth:`run`."""

    def __init__(self, policy: Policy, w: Workload, seed: int = 0, calibrate: bool = True) -> None:
        self.w = w
        self.policy = policy
        # the policy's cost model learns from the times reported below, as live
        self.coord = Coordinator(policy, w.cells, w.cap, calibrate=calibrate)
        self.dur = Durations(w, seed)
        # the executor's costs per rollout / per step: at their means unless spread
        self._fin = Spread(w.finish_delay_s, w.finish_delay_sigma, seed, 1)
        self._proc = Spread(w.process_s, w.process_sigma, seed, 2)
        self._over = Spread(w.step_overhead_s, w.step_overhead_sigma, seed, 3)
        self._last_members: frozenset[int] = frozenset()
        self.stats_regroups = 0
        self.now = 0.0
        self._heap: list[tuple[float, int, str, tuple]] = []
        self._seq = 0
        n = w.cells
        # physical view of the cells (the coordinator holds the logical one)
        self.role = [c.role for c in self.coord.state().cells]
        self.loading = [False] * n
        self.load_until = [0.0] * n
        self.load_to = [0] * n
        self.stepping = [False] * n
        self.phys = [0] * n  # sessions physically on the cell
        self.version_on = [0] * n  # weights loaded on the cell
        self.switches_of = [0] * n
        self.move_at = [0.0] * n  # when the cell's last Move was carried out
        self.stepped = [True] * n  # joined a step since it last moved to training
        self.acc = [0.0] * 5
        self.rate = [0.0] * 5
        for c in range(n):
            self._add(c, +1)
        self.sess: dict[int, _Sess] = {}
        self.on_cell: list[set[int]] = [set() for _ in range(n)]
        # sessions rerouted to a cell and not there yet (some finish before they
        # get there): a later reroute of that cell sends them on, as the gateway
        # routes a session's next call to the cell it is assigned to now
        self.inbound: list[set[int]] = [set() for _ in range(n)]
        self.done_rec: dict[int, tuple[float, float, int]] = {}  # idx -> (dur, acc, vmin)
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
            "wasted_switches": 0,
        }
        self.step_starts: list[float] = []
        self.step_ends: list[float] = []
        self.lag_tokens = 0.0  # token-seconds trained
        self.lag_sum = 0.0  # lag x token-seconds
        self.lag_max = 0
        self.lags: list[int] = []  # per trained rollout: the lag of its oldest token
        self.end_time = 0.0
        self._tick_at: set[float] = set()

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

    def _tick_soon(self) -> None:
        if self.now not in self._tick_at:
            self._tick_at.add(self.now)
            self._push(self.now, "tick", (False,))

    def run(self) -> dict[str, float]:
        w = self.w
        limit = w.max_hours * 3600.0
        self._push(0.0, "tick", (True,))
        while self._heap and self.stats["steps"] < w.steps:
            t, _, kind, p = heapq.heappop(self._heap)
            if t > limit:
                break
            self._advance(t)
            if kind == "tick":
                self._tick_at.discard(t)
                for d in self.coord.handle(Tick(t)):
                    self._execute(d)
                if p[0]:  # the periodic tick
                    self._push(t + w.tick_s, "tick", (True,))
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
        self.end_time = self.now if self.stats["steps"] >= w.steps else max(self.now, limit)
        self._advance(self.end_time)
        return self.metrics()

    def _finish(self, idx: int, epoch: int) -> None:
        s = self.sess.get(idx)
        if s is None or s.epoch != epoch:
            return  # superseded by a pause or a migration
        s.close(min(self.now, s.end()))  # generation ended finish_delay_s ago
        del self.sess[idx]
        self.on_cell[s.phys].discard(idx)
        self.inbound[s.logical].discard(idx)
        self._change(s.phys, "phys", self.phys[s.phys] - 1)
        self.stats["finished"] += 1
        if s.dur >= self.w.timeout_s:
            self.stats["timed_out"] += 1
        self.done_rec[idx] = (s.dur, s.acc, s.vmin)
        self.coord.handle(RolloutFinished(s.logical, idx, version=s.vmin))

    def _pause_all(self, c: int, until: float, version: int) -> None:
        """Sessions on ``c`` stop generating until ``until``, then use ``version``."""
        for idx in self.on_cell[c]:
            s = self.sess[idx]
            if s.progress(self.now) >= s.dur:
                continue  # done generating, its sample on the way (finish_delay_s)
            s.close(self.now)
            s.run_from = max(s.run_from, until)
            s.ver = version
            s.epoch += 1
            self._push(s.end() + self._delay(idx), "done", (idx, s.epoch))

    def _delay(self, idx: int) -> float:
        """Rollout ``idx``'s last token to its sample in the buffer: finish delay plus
        processing (its draws, or the means)."""
        return self._fin[idx] + self._proc[idx]

    def _execute(self, d: Decision) -> None:
        w = self.w
        if isinstance(d, StartRollouts):
            v = self.version_on[d.cell]
            for _ in range(d.n):
                idx = self.stats["started"]
                self.stats["started"] += 1
                s = _Sess(idx, d.cell, self.dur[idx], self.now, v)
                self.sess[idx] = s
                self.on_cell[d.cell].add(idx)
                self._push(s.end() + self._delay(idx), "done", (idx, 0))
            self._change(d.cell, "phys", self.phys[d.cell] + d.n)
        elif isinstance(d, LoadWeights):
            self.stats["weight_loads"] += 1
            self._change(d.cell, "loading", True)
            self.load_until[d.cell] = self.now + w.weight_load_s
            self.load_to[d.cell] = d.version
            self._pause_all(d.cell, self.load_until[d.cell], d.version)
            self._push(self.load_until[d.cell], "loaded", (d.cell, d.version, w.weight_load_s))
        elif isinstance(d, StartStep):
            for c in d.cells:
                self._change(c, "stepping", True)
                self.stepped[c] = True
            self.step_starts.append(self.now)
            work = self._train(d.rollouts)
            per = w.train_s_per_sample
            if w.train_follows_length and d.samples:
                per = work / d.samples  # the samples' mean cost
            dt = dp_step_seconds(d.samples, len(d.cells), per, w.dp_sync_s)
            dt += self._over[len(self.step_starts) - 1]
            members = frozenset(d.cells)
            if self._last_members and members != self._last_members:
                dt += w.regroup_s  # a new DP generation
                self.stats_regroups += 1
            self._last_members = members
            self._push(self.now + dt, "step_done", (d.cells, d.samples, dt))
        elif isinstance(d, Move):
            self.stats["switches"] += 1
            src = d.cell
            self.switches_of[src] += 1
            self.move_at[src] = self.now
            if d.to == "train":
                self.stepped[src] = False
            elif not self.stepped[src]:  # recruited, never trained, sent back
                self.stats["wasted_switches"] += 2
            self._change(src, "role", "draining" if d.to == "train" else "loading")
            if d.to == "rollout":
                self._push(self.now + w.switch_s + w.weight_load_s, "move_done", (src,))
                return
            targets = [t for t, n in d.reroute for _ in range(n)]
            passing = sorted(self.inbound[src])
            self.inbound[src].clear()
            sessions = sorted(self.on_cell[src])
            assert len(targets) == len(sessions) + len(passing), "reroute must cover every session"
            for idx, tgt in zip(passing, targets[len(sessions) :], strict=True):
                self.sess[idx].logical = tgt  # on its way: goes on to the new cell
                self.inbound[tgt].add(idx)
            drained = self.now
            for idx, tgt in zip(sessions, targets, strict=False):
                s = self.sess[idx]
                s.logical = tgt
                self.inbound[tgt].add(idx)  # booked there from now on
                p = s.progress(self.now)
                k = math.ceil(p / w.call_s - 1e-9)
                # the next call boundary, in wall time (after any pause)
                boundary = max(self.now, s.run_from) + (k * w.call_s - p)
                if k * w.call_s >= s.dur:
                    drained = max(drained, s.end())  # finishes here before its next call
                    continue
                drained = max(drained, boundary)
                self._push(boundary, "arrive", (idx, s.epoch))
            self._push(drained + w.switch_s, "move_done", (src,))

    def _arrive(self, idx: int, epoch: int) -> None:
        s = self.sess.get(idx)
        if s is None:
            return
        assert s.epoch == epoch, "a draining cell's session was paused mid-drain"
        src, tgt = s.phys, s.logical
        self.inbound[tgt].discard(idx)
        s.close(self.now)
        self.on_cell[src].discard(idx)
        self._change(src, "phys", self.phys[src] - 1)
        if self.role[tgt] != "rollout" or self.phys[tgt] >= self.w.cap:
            self.stats["broken"] += 1  # nowhere to run: the session is lost
            del self.sess[idx]
            self.done_rec[idx] = (s.gen, s.acc, s.vmin)  # counted (as broken): books stay even
            self.coord.handle(RolloutFinished(s.logical, idx, version=s.vmin))
            return
        cost = self.w.migrate_s if self.w.kv_move else self.w.reprefill_s
        version = self.version_on[tgt]
        if self.loading[tgt]:  # arrives while the target loads weights: waits for it too
            cost += max(0.0, self.load_until[tgt] - self.now)
            version = self.load_to[tgt]
        s.phys = tgt
        s.run_from = self.now + cost
        s.ver = version
        s.epoch += 1
        self.on_cell[tgt].add(idx)
        self._change(tgt, "phys", self.phys[tgt] + 1)
        self.stats["migrations"] += 1
        self._push(s.end() + self._delay(idx), "done", (idx, s.epoch))

    def _move_done(self, c: int) -> None:
        if self.on_cell[c]:  # a session still here when the cell changes role
            self.stats["broken"] += len(self.on_cell[c])
        target = self.coord.cell(c).target
        assert target is not None
        self._change(c, "role", target)
        self.coord.handle(MoveDone(c, seconds=self.now - self.move_at[c]))
        self.version_on[c] = self.coord.version
        self._tick_soon()

    def _loaded(self, c: int, v: int, secs: float) -> None:
        self._change(c, "loading", False)
        self.version_on[c] = max(self.version_on[c], v)
        self.coord.handle(WeightsLoaded(c, v, seconds=secs))

    def _step_done(self, cells: tuple[int, ...], samples: int, secs: float) -> None:
        for c in cells:
            self._change(c, "stepping", False)
        self.stats["steps"] += 1
        self.stats["trained"] += samples
        self.step_ends.append(self.now)
        self.coord.handle(StepFinished(cells, seconds=secs))
        for c in cells:
            self.version_on[c] = self.coord.version
        self._tick_soon()

    def _train(self, rollouts: tuple[int, ...]) -> float:
        """Record the lag of every token a step from the current weights trains.

        Returns the step's training work in cell-seconds (the samples' costs).
        """
        w = self.coord.version  # the step starts from these weights
        work = 0.0
        for idx in rollouts:
            dur, acc, vmin = self.done_rec.pop(idx)
            work += self.w.train_cost(dur)
            self.lag_tokens += dur
            self.lag_sum += w * dur - acc
            self.lag_max = max(self.lag_max, w - vmin)
            self.lags.append(w - vmin)
        return work

    def metrics(self) -> dict[str, float]:
        w = self.w
        secs = max(self.end_time, 1e-9)
        hours = secs / 3600.0
        total = w.cells * secs
        rb, ri, tb, ti, sw = self.acc
        st = self.stats

        def frac(x: float, y: float) -> float:
            return x / y if y > 0 else 0.0

        k = len(self.step_starts) // 4
        starts = self.step_starts
        if len(starts) - 1 > k:
            steady = w.batch * (len(starts) - 1 - k) / (starts[-1] - starts[k]) * 3600.0
        else:
            steady = 0.0
        return {
            "samples_per_hour": st["trained"] / hours,
            "steady_per_hour": steady,
            "hours": hours,
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
            "lag_mean": max(0.0, frac(self.lag_sum, self.lag_tokens)),  # -0.0 from rounding
            "lag_max": float(self.lag_max),
            "lag_rollout_mean": sum(self.lags) / len(self.lags) if self.lags else 0.0,
            "role_switches": float(st["switches"]),
            "switches_per_cell_day": st["switches"] / (w.cells * secs / 86400.0),
            "max_switches_one_cell": float(max(self.switches_of, default=0)),
            "sessions_broken": float(st["broken"]),
            "migrations": float(st["migrations"]),
            "weight_loads": float(st["weight_loads"]),
            "wasted_switches": float(st["wasted_switches"]),
            "regroups": float(self.stats_regroups),
        }


def simulate(
    policy: Policy, workload: Workload, seed: int = 0, calibrate: bool = True
) -> dict[str, float]:
    """Run ``policy`` on the seeded ``workload``; returns flat metrics.

    ``calibrate=False``: the policy keeps its configured costs all run (no cost model
    learnt from the run's events).
    """
    return Simulator(policy, workload, seed, calibrate).run()
