"""Healing lost cells: the executor's fault handling (infra/cells/executor.py).

A cell whose worker process dies is *lost*: the gateway stops routing to its engine (its
sessions' next calls re-prefill on another cell), a step it was in is aborted (the DP
rendezvous is replaced so the survivors stop at once) and an action on it waits for the
cell to heal. The worker the cluster gains next (the nanny restarts a killed worker) takes
the lost cell's place and role once it has imported what its cell preloads (no step forms a
group with a cell still importing torch), and a rollout cell's engine starts with the newest
weights before the gateway routes to it. The aborted step is then retried, the same step on the
same samples from the same version, unless it committed before the loss
(storage/commits.py). Rollout and processing tasks that died with a worker are rerun by
Dask; each has a deadline, and one that no cell can take (Dask's ``no-worker``) for longer
than a heal stops the run.

``Healing`` holds these methods; ``Executor`` inherits them and owns the state they read
(``infra.cells.membership`` keeps the books of which worker holds each cell).
"""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from infra.cells.cluster import ROLES, CellLost
from infra.cells.membership import Observed
from storage.checkpoints import read_commit
from storage.commits import roll_forward
from tasks.sched.coordinator import Event
from tasks.train.dp import host_store

log = logging.getLogger(__name__)

UNRUNNABLE_CHECK_S = 5.0  # how often in-flight tasks are checked for waiting on no cell
LOST_REASON = (
    "cell lost: its rollout task died with its cell (placed on {cell}); the group was rolled "
    "out again as new sessions, this one is never trained on"
)


def preloaded(plugin: Any) -> None:
    """On a cell: return once the modules its plugin preloads are imported (a module that
    another thread is importing is waited for; one that fails fails again where used)."""
    for name in getattr(plugin, "preload", ()):
        try:
            importlib.import_module(name)
        except Exception as exc:
            log.debug("cell preload %s: %s", name, exc)


class ExecutorError(RuntimeError):
    """A decision could not be carried out (the message says which and what to check)."""


@dataclass(frozen=True)
class CommittedStep:
    """A step found committed in the store (its member was lost after the commit)."""

    step: int
    weight_version: int
    checkpoint: str
    metrics: dict[str, float] = field(default_factory=dict)


class Healing:
    """Lost cells, their replacements, deadlines and step retries (mixed into ``Executor``,
    whose attributes these methods use)."""

    def _watch(self, force: bool = False) -> list[Event]:
        """Ask for a look at the cluster's workers (at most every ``watch_s``, one at a time;
        ``force``: now, or as soon as the look under way is answered). The look is a round
        trip to the scheduler (15-35 ms each on a loaded host, several a second: 5-32 s of
        a run's loop time when the loop made them itself), so it runs on a thread of its own
        and its answer comes back to the loop as a ``workers`` event (`_seen`)."""
        now = time.monotonic()
        if self._looking is not None:
            self._look_again = self._look_again or force
            return []
        if not force and now - self._watched < self.watch_s:
            return []
        self._watched = now
        keys = self._unrunnable_keys(now)
        try:
            look = self._peek.submit(self._look, keys)
        except RuntimeError:  # the executor is closing: nothing to look at any more
            return []
        self._looking = look
        look.add_done_callback(lambda f: self._q.put(("workers", f)))
        return []

    def _look(self, keys: dict[int, Any] | None) -> tuple[set[str], dict[Any, str] | None]:
        """Off the loop: the workers the scheduler knows and, when ``keys`` (group -> its
        task's key) is given, those tasks' states."""
        alive = self.cells.workers()
        states = None
        if keys:
            try:
                states = self.cells.task_states(list(keys.values()))
            except Exception as exc:  # the scheduler is unreachable: look again later
                log.warning("cannot read the states of the rollout tasks: %s", exc)
        return alive, states

    def _seen(self, look: Any) -> list[Event]:
        """On the loop: what a look at the workers found (`_watch`), carried out: lost cells,
        their replacements, overdue heals, rollout/processing deadlines, tasks no cell can
        run, an aborted step's retry."""
        self._looking = None
        try:
            alive, states = look.result()
        except Exception as exc:  # the scheduler is unreachable: say so, try again next tick
            log.warning("cannot list the cluster's workers: %s", exc)
            return []
        finally:
            if self._look_again:
                self._look_again = False
                self._watch(force=True)
        now = time.monotonic()
        obs = self._observe(alive, now)
        if obs.overdue:
            i, t = obs.overdue[0]
            raise ExecutorError(
                f"cell {i} (worker {self.lost_addr.get(i)}) was lost {t:.0f}s ago and no worker "
                f"took its place (bound {self.heal_timeout_s:.0f}s); restart a worker or add one"
            )
        for g in self.groups.values():
            late = g.phase in ("rollout", "process") and g.job is not None and now > g.deadline
            if late and not g.job.done():
                raise ExecutorError(
                    f"{g.phase} of group g{g.index} not done {self.job_timeout_s:.0f}s after "
                    f"it started (its Dask task: {self._describe(g.job)}); check the cells"
                )
        if states is not None:
            self._check_unrunnable(states, now)
        if self.step_jobs and self.step_retry is None:
            bound = self.step_timeout_s + self.heal_timeout_s
            late = time.time() - self.step_t0 - bound
            if late > 0 and not all(j.done() for j in self.step_jobs):
                states_ = ", ".join(self._describe(j) for j in self.step_jobs)
                raise ExecutorError(
                    f"step {self.step_plan.step} not done {bound:.0f}s after it started "
                    f"(scheduler.step_timeout_s + cluster.heal_timeout_s); its members: {states_}"
                )
        return self._maybe_retry_step(now)

    def _observe(self, alive: set[str], now: float) -> Observed:
        """What the workers ``alive`` mean for the cells, carried out: each lost cell is
        recorded and its step aborted (`_on_lost`), each spare bound takes a lost cell's
        place (`_heal`, on the pool)."""
        lost_addr = {i: self.addrs[i] for i in range(len(self.addrs))}
        obs = self.membership.observe(alive, now)
        for i in obs.lost:
            self._on_lost(i, lost_addr[i])
        for i, addr in obs.heal:
            log.warning("cell %d: worker %s takes the place of %s", i, addr, self.lost_addr[i])
            self._pool.submit(self._guard_heal, i, addr)
        return obs

    def _unrunnable_keys(self, now: float) -> dict[int, Any] | None:
        """The in-flight rollout and processing tasks to check for waiting on no cell (group
        -> task key), every ``UNRUNNABLE_CHECK_S``; None when the check is not due."""
        if now - self._unrunnable_checked < UNRUNNABLE_CHECK_S:
            return None
        self._unrunnable_checked = now
        keys = {
            g.index: g.job.key
            for g in self.groups.values()
            if g.phase in ("rollout", "process")
            and g.job is not None
            and getattr(g.job, "key", None) is not None
            and not g.job.done()
        }
        self._unrunnable = keys
        return keys

    def _check_unrunnable(self, states: dict[Any, str], now: float) -> None:
        """A rollout or processing task that no live cell can take (Dask's ``no-worker``:
        no cell holds its resources) for longer than a heal is a fault, not a wait: the
        run stops and says which, instead of waiting out the task's deadline. ``states``:
        the scheduler's word on the tasks `_unrunnable_keys` named; a group that moved on
        since (its rollout ended, its processing started) is not held to its old task."""
        keys = self._unrunnable
        waiting = [
            i
            for i, k in keys.items()
            if states.get(k) == "no-worker"
            and (g := self.groups.get(i)) is not None
            and g.job is not None
            and getattr(g.job, "key", None) == k
            and not g.job.done()
        ]
        self._no_worker = {i: self._no_worker.get(i, now) for i in waiting}
        for i, since in self._no_worker.items():
            if now - since > self.heal_timeout_s:
                g = self.groups[i]
                raise ExecutorError(
                    f"{g.phase} of group g{i}: no cell could run its task for {now - since:.0f}s "
                    f"(Dask state no-worker; bound cluster.heal_timeout_s="
                    f"{self.heal_timeout_s:.0f}); cells and roles: {self.cells.roles}"
                )

    def _describe(self, job: Any) -> str:
        key = getattr(job, "key", None)
        if key is None:
            return "unknown"
        try:
            return self.cells.task_state(key)
        except Exception as exc:
            return f"unknown ({exc})"

    def _on_lost(self, i: int, addr: str) -> None:
        """Cell ``i``'s worker ``addr`` is gone: stop routing to it, abort its step, and
        give the tasks Dask reruns elsewhere a fresh deadline."""
        self.lost_addr[i] = addr
        self.stats.cells_lost += 1
        cid = self.cells.cell_id(addr)
        log.warning("cell %d (%s, role %s): its worker is gone", i, cid, self.roles[i])
        self.record(i, "lost", self.roles[i], "its worker process is gone", f"worker {addr}")
        try:
            self.gateway.drop_engine(cid)  # sessions re-prefill elsewhere at their next call
        except Exception as exc:
            log.warning("dropping the engine of %s: %s", cid, exc)
        now = time.monotonic()
        for g in self.groups.values():
            if g.phase in ("rollout", "process"):
                g.deadline = max(g.deadline, now + self.job_timeout_s)
        if self.step_jobs and i in self.step_cells and self.step_retry is None:
            self._abort_step(f"member cell {cid} was lost")

    def _guard_heal(self, i: int, addr: str) -> None:
        try:
            with self._cell_locks[i]:
                self._heal(i, addr)
        except Exception as exc:
            if isinstance(exc, CellLost) or not self._alive(addr):
                log.warning("cell %d: its new worker %s died too (%s)", i, addr, exc)
                self.membership.heal_failed(i)
                return
            log.exception("healing cell %d failed", i)
            self._q.put(("error", f"heal of cell {i}", exc))

    def _heal(self, i: int, addr: str) -> None:
        """Worker ``addr`` takes lost cell ``i``'s place and role (a rollout cell serves the
        newest weights before the gateway routes to it); a move or load that was under way
        is finished by the action itself, which waits for this."""
        old = self.lost_addr[i]
        self.cells.rebind(old, addr)
        # a restarted worker imports torch, transformers and the tasks in the background
        # (10-60 s on a loaded host); it takes its role once they are in: the members of a
        # step it joins would otherwise wait for it at the DP rendezvous, whose timeout
        # does not know about imports (a 2-member retry failed so: issue 27)
        t0 = time.monotonic()
        self.cells.run_on(addr, preloaded)
        warm_s = time.monotonic() - t0
        self.engine_url.pop(i, None)
        self.engine_version.pop(i, None)
        self.routed.discard(i)
        role = self.roles[i]
        if role == "rollout":
            self.cells.set_role(addr, "loading")
            self._serve(i)
        self.cells.set_role(addr, role if role in ROLES else "idle")
        if role == "train":
            self.dp_left = True  # the next step forms a new group with the newcomer
        self.membership.healed(i)
        self.record(
            i, "rejoin", role, f"worker {old} was lost", f"worker {addr}", {"wait_s": warm_s}
        )
        self._q.put(("healed", i))

    def _mark_lost_sessions(self, handles: list[Any]) -> None:
        """Sessions of a group that its finished task did not return were started by an
        attempt of the task that died with its cell (Dask ran it again, with new sessions):
        their calls stay in ``tito``, and a ``rollouts`` row with status ``lost`` marks
        them, so that SQL tells them apart (no reward: they are never trained on)."""
        groups = {h.group_id for h in handles}
        returned = {h.session_id for h in handles}
        rows = []
        for gid in sorted(groups):
            for s in self.gateway.group_sessions(gid):
                if s["session_id"] in returned:
                    continue
                self.gateway.end_session(s["session_id"])
                meta = s["meta"]
                rows.append(
                    {
                        "run_id": self.run_id,
                        "session_id": s["session_id"],
                        "group_id": gid,
                        "step": meta.get("step"),
                        "task_id": meta.get("task_id"),
                        "status": "lost",
                        "reward": None,
                        "n_calls": s["calls"],
                        "n_tokens_unique": s["tokens"],
                        "n_tokens_flat": None,
                        "reason": LOST_REASON.format(cell=meta.get("cell_id") or "?"),
                        "parent_session_id": None,
                    }
                )
        if rows:
            log.warning("%d session(s) of %s lost with their cell", len(rows), sorted(groups))
            self.store.append("rollouts", rows)

    def _abort_step(self, why: str) -> None:
        """Stop the running step's attempt: cancel members that have not started, and
        replace the DP rendezvous so members waiting to meet fail at once (members inside
        a collective fail when their peer's connection closes). Once per attempt: a loss
        seen twice (a look at the workers, a member's failure) aborts it once."""
        if self.step_retry is not None:
            return
        plan = self.step_plan
        self.step_retry = (time.monotonic(), why)
        self.stats.step_retries += 1
        for j in self.step_jobs:
            if not j.done():
                j.cancel()
        self._dp_store, self.dp_port = host_store(self.dp_host, 0, timeout_s=self.step_timeout_s)
        log.warning("step %d (attempt %d) aborted: %s", plan.step, self.step_attempt, why)
        for i in self.step_cells:
            self.record(i, "step_abort", self.roles[i], why, f"step {plan.step}")

    def _maybe_retry_step(self, now: float) -> list[Event]:
        """Retry an aborted step once its old members have stopped and its cells are back."""
        if self.step_retry is None:
            return []
        since, why = self.step_retry
        running = [j for j in self.step_jobs if not j.done()]
        lost = [i for i in self.step_cells if self.membership.is_lost(i)]
        if running or lost:
            bound = self.heal_timeout_s + self.step_timeout_s
            if now - since > bound:
                raise ExecutorError(
                    f"step {self.step_plan.step}: its retry waited {now - since:.0f}s (bound "
                    f"{bound:.0f}s) for {len(running)} old member(s) to stop and cells {lost} "
                    "to come back"
                )
            return []
        self.step_retry = None
        plan = self.step_plan
        rec = read_commit(self.store, self.run_id, plan.version + 1)
        if rec is not None and rec.get("step") == plan.step and rec.get("run_id") == self.run_id:
            roll_forward(self.store, self.run_id)
            log.warning("step %d had committed before the loss: not trained again", plan.step)
            row = rec["steps"]
            metrics = {f"train/{k}": row[k] for k in ("loss", "tokens", "grad_norm", "lag_mean")}
            metrics["train/reward_mean"] = row["reward"]
            done = CommittedStep(plan.step, plan.version + 1, row["checkpoint"], metrics)
            return self._finish_step([done])
        self.step_attempt += 1
        if self.step_attempt > self.max_step_retries:
            raise ExecutorError(
                f"step {plan.step}: {self.step_attempt} attempts lost members ({why}); giving up"
            )
        self.generation += 1
        self.members, self.dp_left = tuple(self.cell_id(i) for i in self.step_cells), False
        plan = replace(
            plan,
            generation=self.generation,
            members=self.members,
            workers=tuple(self.addrs[i] for i in self.step_cells),
            port=self.dp_port,
        )
        for i in self.step_cells:
            self.record(
                i, "step", "train", f"retry {self.step_attempt}: {why}",
                f"step {plan.step} gen {plan.generation}",
            )  # fmt: skip
        self._submit_step(plan)
        return []

    def _step_cell_lost(self, grace_s: float) -> bool:
        """Whether a worker of the step's members is gone (the scheduler may learn of a
        death a little after a surviving member's collective failed on it)."""
        deadline = time.monotonic() + grace_s
        while True:
            if any(self.membership.is_lost(i) for i in self.step_cells):
                return True
            try:
                alive = self.cells.workers()
            except Exception:
                alive = set(self.addrs)
            if any(w not in alive for w in self.step_plan.workers):
                # the loss is handled (recorded, the step aborted) as a look at the workers
                # handles it, before the member's failure that revealed it
                self._observe(alive, time.monotonic())
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)

    def _guard(self, what: tuple, fn, *args) -> None:
        """Run a control-plane action on cell ``what[1]`` under its lock; if the cell's
        worker died under it, wait (bounded) for the cell to heal and run it again there."""
        i = what[1]
        for _ in range(3):
            addr = self.addrs[i]
            try:
                with self._acting_on(i), self._cell_locks[i]:
                    fn(*args)
                return
            except Exception as exc:
                if isinstance(exc, CellLost) or not self._alive(addr):
                    log.warning("%s of cell %d: its worker %s is gone (%s)", what[0], i, addr, exc)
                    if self._wait_healed(i, addr):
                        continue
                    exc = ExecutorError(
                        f"{what[0]} of cell {i}: its worker {addr} was lost and no worker took "
                        f"its place within {self.heal_timeout_s:.0f}s"
                    )
                log.exception("executor action %s failed", what)
                self._q.put(("error", f"{what[0]} of cell {i}", exc))
                return
        self._q.put(("error", f"{what[0]} of cell {i}", ExecutorError("lost 3 times in a row")))

    def _alive(self, addr: str) -> bool:
        try:
            return addr in self.cells.workers()
        except Exception:  # the scheduler itself is unreachable: not a cell fault
            return True

    def _wait_healed(self, i: int, addr: str) -> bool:
        """Wait until cell ``i`` runs on a worker other than ``addr`` with its role back."""
        deadline = time.monotonic() + self.heal_timeout_s + 30
        while time.monotonic() < deadline and not self._closing.is_set():
            if self.addrs[i] != addr and not self.membership.is_lost(i):
                return True
            time.sleep(0.1)
        return False
