"""The scheduling flow: the run's loop, driven by the same Coordinator as the simulator.

    events  ->  Coordinator.handle(event)           (pure: tasks/sched/)
    Tick    ->  decisions  ->  Executor.apply(d)    (one door: infra/cells/executor.py)

Decisions start rollouts (a Prefect task per group, harnesses on harness slots), move cells
between roles (Dask resources, gateway withdrawal with KV moves, parked engines, the DP
group), load weights and start data-parallel steps (a Prefect task per member). Finished
groups stream to processing as they end; in ``async`` and ``elastic`` there is no step
barrier. The flow ends after ``train.steps`` optimizer steps, stops the rollouts still
running (cooperatively, through a distributed Event) and writes the role timeline and the
utilisation table as files and Prefect artifacts.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from typing import Any

import dask
from distributed import Event as DaskEvent
from distributed import Variable
from prefect import flow
from prefect.logging import get_run_logger
from tqdm import tqdm

from flows import live
from flows.config import RunConfig
from flows.evaluation import HeldOut
from flows.procs import check_stop, stop_points
from flows.progress import Progress
from flows.report import write_report
from flows.submits import PROCESS, ROLLOUT, STEP, PendingJob, Submits
from infra.cells.executor import EngineSpec, Executor
from storage.store import Store
from tasks.env.heldout import train_task_seed
from tasks.handles import GroupSpec
from tasks.process import process_group
from tasks.rollout import FailedSessions, RolloutsFailed, admin_token_variable, rollout_group
from tasks.sched.config import build_policy, coordinator_args, group_shape, paced_workload
from tasks.sched.coordinator import (
    Coordinator,
    Decision,
    LoadWeights,
    Move,
    SchedState,
    StartRollouts,
    StartStep,
    Tick,
)
from tasks.sched.waterlevel import dp_step_seconds
from tasks.sched.workload import Durations
from tasks.train.dp import StepPlan
from tasks.train_step import train_member

log = logging.getLogger(__name__)

CLOCK_SKEW_NS = 300 * 10**9
STOP_DRAIN_S = 10.0  # after Ctrl-C: how long rollouts get to end at their next step


class PrefectWork:
    """The executor's ``Work`` port: units of work as Prefect tasks on the cells."""

    def __init__(
        self,
        run_id: str,
        cfg: RunConfig,
        store: Store,
        gateway,
        stop_event: str,
        first_group: int = 0,
    ):
        self.run_id, self.cfg, self.store = run_id, cfg, store
        self.gateway = gateway
        self.stop_event = stop_event
        self.first_group = first_group  # a resumed run's groups continue the numbering
        self.total = first_group + cfg.train.steps * cfg.rollout.groups_per_step
        self.since: dict[int, int] = {}
        self.failures = FailedSessions(cfg.rollout)  # a broken agent stops the run
        # the executor asks for processing off the loop: the loop checks the tally under
        # this lock, so a failed group's rows are in the store before the run stops
        self.failing = threading.Lock()
        sc = cfg.scheduler
        # paced by a workload file: group i lasts the file's rollout i, steps its step model
        self.workload = paced_workload(
            sc.pacing,
            cells=cfg.cluster.rollout_cells + cfg.cluster.train_cells,
            cap=sc.groups_per_cell,
            batch=cfg.rollout.groups_per_step,
            steps=cfg.train.steps,
            tick_s=sc.tick_s,
        )
        self.durations = Durations(self.workload, sc.seed) if self.workload else None
        # the submits, off the loop's thread, in the flow run's context (flows/submits.py)
        self.submits = Submits()

    def close(self) -> None:
        """The submits already asked for are made, then their thread ends."""
        self.submits.close()

    def spec(self, index: int, cell_id: str | None = None) -> GroupSpec:
        r = self.cfg.rollout
        index += self.first_group  # the run's group number: new tasks on a resumed run
        n, env_s, env_sigma = group_shape(
            self.cfg.scheduler.pacing, r.subtasks, index, self.total, self.cfg.scheduler.seed
        )
        return GroupSpec(
            index=index,
            group_id=f"g{index}",
            task_seed=train_task_seed(r.seed, index),  # held-out seeds are checked against it
            subtasks=n,
            step=index // r.groups_per_step,
            env_step_s=env_s,
            env_step_sigma=env_sigma,
            cell_id=cell_id,
            **self._paced(index - self.first_group),
        )

    def _paced(self, index: int) -> dict[str, float]:
        """A paced group's slot time and call interval (the simulator's rollout ``index``)."""
        if self.durations is None:
            return {}
        return {
            "duration_s": self.durations[index],
            "call_s": self.workload.call_s,
            "t_start": time.time(),
        }

    def step_pace_s(self, plan: StepPlan) -> float:
        """Device time of a paced step: the simulator's step model on the same rollouts."""
        if self.workload is None:
            return 0.0
        w, b = self.workload, len(plan.groups)
        work = sum(w.train_cost(self.durations[i]) for i in plan.groups)  # as the simulator
        return dp_step_seconds(b, len(plan.members), work / max(1, b), w.dp_sync_s)

    def group_id(self, index: int) -> str:
        """The gateway's group id of the executor's group ``index``."""
        return f"g{index + self.first_group}"

    def rollout(self, index: int, cell_id: str) -> PendingJob:
        self.since[index] = time.time_ns() - CLOCK_SKEW_NS
        with dask.annotate(resources={"harness": 1}):  # the submit's context carries it
            return self.submits.submit(
                ROLLOUT,
                rollout_group.submit,
                self.gateway.url,
                admin_token_variable(self.run_id),  # the token itself never is a parameter
                self.store,
                self.run_id,
                self.spec(index, cell_id),
                self.cfg.rollout,
                self.stop_event,
            )

    def process(
        self, index: int, sessions, version: int, workers: tuple[str, ...] = ()
    ) -> PendingJob:
        """Processing of group ``index`` on one of ``workers`` (the executor's steady rollout
        cells, ``Executor.process_addrs``); loose: where none of them is up, Dask runs it on
        any cell rather than wait (``allow_other_workers`` counts only workers that are gone,
        not busy ones)."""
        group = index + self.first_group
        step = group // self.cfg.rollout.groups_per_step
        where = (
            dask.annotate(workers=list(workers), allow_other_workers=True)
            if workers
            else contextlib.nullcontext()
        )
        with where:
            job = self.submits.submit(
                PROCESS,
                process_group.submit,
                self.store,
                self.run_id,
                group,
                step,
                sessions,
                version,
                self.cfg.train,
                self.since.pop(index, None),
            )
        with self.failing:
            self.failures.add(sessions)
            if self.failures.error is not None:  # the run stops at the loop's next check
                try:  # this group's rollouts rows, with every session's reason, reach the store
                    job.result(timeout=120)
                except Exception as exc:
                    log.warning("processing the failed group g%d: %s", group, exc)
        return job

    def step(self, plan: StepPlan) -> list[PendingJob]:
        s = self.cfg.scheduler
        jobs = []
        for rank, addr in enumerate(plan.workers):
            with dask.annotate(resources={"train": 1}, workers=[addr], allow_other_workers=False):
                job = self.submits.submit(
                    STEP,
                    train_member.submit,
                    self.store,
                    self.run_id,
                    plan,
                    rank,
                    self.cfg.train,
                    s.pacing.train_s_per_token,
                    s.step_timeout_s,
                    s.dp_backend,
                    s.mode,
                )
            jobs.append(job)
        return jobs


def explain(d: Decision, s: SchedState, cfg: RunConfig, v0: int = 0) -> str:
    """Why the policy decided ``d``: the state it saw, with numbers (for the ``cells`` rows);
    versions in the run's count (the coordinator's ``v`` is the run's ``v0 + v``)."""
    sc = cfg.scheduler
    oldest = v0 + min((v.version for v in s.versions), default=s.version)
    base = (
        f"{sc.mode}: {s.water_level} groups buffered, {s.in_flight} in flight "
        f"(oldest base v{oldest}, lag bound {cfg.train.max_staleness}), v{v0 + s.version}, "
        f"step {'running' if s.step_running else 'idle'}, "
        f"{s.count('rollout')} rollout / {s.count('train')} train cells, "
        f"marks {sc.low_mark:g}/{sc.high_mark:g}s"
    )
    if isinstance(d, Move):
        return f"move to {d.to} ({sum(n for _, n in d.reroute)} groups rerouted); {base}"
    if isinstance(d, LoadWeights):
        return f"load v{v0 + d.version}; {base}"
    if isinstance(d, StartStep):
        return f"step on {d.samples} groups over {len(d.cells)} member(s); {base}"
    return base


@flow(name="schedule", flow_run_name="{run_id}-schedule")
def schedule(
    run_id: str,
    cfg: RunConfig,
    store: Store,
    start_version: int,
    first_step: int = 0,
    first_group: int = 0,
    steps: int | None = None,
) -> dict[str, Any]:
    """Events -> Coordinator -> decisions -> Executor, until ``steps`` optimizer steps are done
    (default ``train.steps``); a resumed run starts at step ``first_step`` from version
    ``start_version``, its rollout groups numbered from ``first_group``."""
    logger = get_run_logger()
    steps = cfg.train.steps if steps is None else steps
    cells, gateway, model_dir = live.lookup(run_id)
    sc, r = cfg.scheduler, cfg.rollout
    n_cells = len(cells.roles)
    policy = build_policy(
        sc,
        n_cells=n_cells,
        rollout_cells=cfg.cluster.rollout_cells,
        batch=r.groups_per_step,
        max_lag=cfg.train.max_staleness,
        timeout_s=r.timeout_s,
    )
    coord = Coordinator(policy, n_cells, sc.groups_per_cell, **coordinator_args(sc.pacing))
    stop_event = f"gyre-stop-{run_id}"
    work = PrefectWork(run_id, cfg, store, gateway, stop_event, first_group)
    engine = EngineSpec(
        model_dir=model_dir,
        max_batch_size=cfg.model.max_batch_size,
        kv_cache_tokens=cfg.model.kv_cache_tokens,
        audit_dir=cfg.model.audit_dir,
        decode_step_s=sc.pacing.decode_step_s,
        prefill_tokens_per_s=sc.pacing.prefill_tokens_per_s,
    )
    ex = Executor(
        cells,
        gateway,
        store,
        run_id,
        work,
        engine,
        version=start_version,
        first_step=first_step,
        drain_timeout_s=sc.drain_timeout_s,
        step_timeout_s=sc.step_timeout_s,
        shuffle_buffer=sc.shuffle_buffer,
        seed=sc.seed,
        heal_timeout_s=cfg.cluster.heal_timeout_s,
        dp_host=cfg.cluster.advertise_host,  # the DP rendezvous: where the cells meet
        # a rollout ends by its own timeout; processing and the margins on top
        job_timeout_s=r.timeout_s + sc.drain_timeout_s + 600,
        # paced by a workload file: role changes and weight loads cost what the simulator says
        switch_s=work.workload.switch_s if work.workload else 0.0,
        weight_load_s=work.workload.weight_load_s if work.workload else 0.0,
    )
    held = HeldOut(run_id, cfg, store, gateway, start_version, first_step, steps)
    roles = coord.state().cells
    ex.start(tuple(c.role for c in roles), f"{sc.mode}: initial roles")
    logger.info(
        "%s: %d cells (%s), %d groups of %d per step, up to %d groups per rollout cell",
        sc.mode,
        n_cells,
        ", ".join(f"{ex.cell_id(i)}={c.role}" for i, c in enumerate(roles)),
        r.groups_per_step,
        r.group_size,
        sc.groups_per_cell,
    )
    DaskEvent(stop_event).clear()
    # the gateway's admin token reaches the rollout tasks through the Dask scheduler: a
    # Prefect parameter would show it in the UI
    token = Variable(admin_token_variable(run_id), client=cells.client)
    token.set(gateway.admin_token)
    bar = tqdm(total=steps, desc=f"gyre {run_id} {sc.mode}", unit="step", file=sys.stderr)
    progress = Progress(run_id, first_step, steps)
    t0, t0_wall = time.monotonic(), time.time()
    decisions = 0
    interrupted = False

    def show() -> tuple[int, int]:
        """Draw the progress line and artifact; the (steps, failed sessions) drawn."""
        steps_done, failed = ex.stats.steps, work.failures.n_failed
        bar.update(steps_done - bar.n)
        progress.update(steps_done, _reward(ex), failed)
        s = coord.state()
        bar.set_postfix_str(
            f"v{ex.version} level {s.water_level} in flight {s.in_flight} "
            f"{s.count('rollout')}R/{s.count('train')}T "
            f"failed {failed}/{work.failures.n_sessions} sessions"
        )
        return steps_done, failed

    last_shown = (0, 0)  # (steps, failed sessions) on the progress line
    try:
        with stop_points():
            while True:
                check_stop()  # Ctrl-C/SIGTERM lands here (flows/procs.py)
                for ev in ex.events(timeout=sc.tick_s):
                    coord.handle(ev)
                held.poll(ex)  # held-out evaluations (flows/evaluation.py)
                if ex.stats.steps >= steps:
                    break
                state = coord.state()
                for d in coord.handle(Tick(time.monotonic() - t0)):
                    if not isinstance(d, StartRollouts):
                        decisions += 1
                    ex.apply(d, explain(d, state, cfg, ex.version0))
                if (ex.stats.steps, work.failures.n_failed) != last_shown:
                    last_shown = show()  # a step, or a failed session (shown at once)
                try:
                    with work.failing:  # a broken agent: the run stops, naming the reasons
                        work.failures.check()
                except RolloutsFailed:
                    show()  # failures the tally took since the line was drawn
                    raise
        check_stop()  # one that came during the last tick
    except BaseException:
        interrupted = True  # Ctrl-C, SIGTERM, or a failure: stop quickly
        raise
    finally:
        bar.close()
        DaskEvent(stop_event).set()
        _drain(ex, cfg, logger, bound=STOP_DRAIN_S if interrupted else None)
        try:
            if not interrupted and ex.stats.steps >= steps:
                held.finish(ex)  # the final version's held-out evaluation
        except Exception:  # training is done and committed: the run still ends well
            logger.exception("the final held-out evaluation failed")
        finally:
            ex.close()
            work.close()
            try:  # no use once the run's gateway stops: leave none behind on the scheduler
                token.delete()
            except Exception as exc:
                logger.warning("could not delete the admin token variable: %s", exc)
    # the last step ends the loop before the progress line shows it
    progress.update(ex.stats.steps, _reward(ex), work.failures.n_failed)
    seconds = time.monotonic() - t0
    report = write_report(ex, store, run_id, seconds, cfg.scheduler.mode)
    logger.info("%s: %d steps in %.1fs; %s", sc.mode, ex.stats.steps, seconds, report["summary"])
    return {
        "weight_version": ex.version,
        "seconds": seconds,
        "t0_wall": t0_wall,  # the first decision (time.time()); steps' t_end are on this clock
        "group_times": [(g.index, g.t_start, g.t_rollout, g.t_done) for g in ex.groups.values()],
        "timeline": list(ex.timeline),  # role changes and steps per cell (bench/modes.py)
        "stats": ex.stats,
        "submits": work.submits.stats.as_dict(),  # Prefect submits, off the loop's thread
        "decisions": decisions,
        "report": report,
        "last_step": getattr(ex, "last_step", None),
        "trained_groups": [g.index for g in ex.groups.values() if g.phase == "trained"],
    }


def _reward(ex: Executor) -> float | None:
    last = getattr(ex, "last_step", None)
    return None if last is None else (last.metrics or {}).get("train/reward_mean")


def _drain(ex: Executor, cfg: RunConfig, logger, bound: float | None = None) -> None:
    """Wait (bounded) for the rollouts the stop event ends; what is left is reported."""
    if bound is None:
        bound = cfg.scheduler.drain_timeout_s + cfg.rollout.timeout_s + 30
    deadline = time.monotonic() + bound
    jobs = [g.job for g in ex.groups.values() if g.job is not None]
    while jobs and time.monotonic() < deadline:
        jobs = [j for j in jobs if not j.done()]
        time.sleep(0.2)
    if jobs:
        logger.warning(
            "%d rollout/process tasks still running %.0fs after the stop event; leaving them",
            len(jobs),
            bound,
        )
