"""Colocate vs async vs elastic on the real stack, beside the simulator's prediction of each run.

One Prefect flow, one Dask LocalCluster of ``--cells`` cells reused by every mode (so no
mode pays a different start-up), the tiny model, the bundled arithmetic environment driven
by the black-box harness over the official openai client through the gateway. Each mode is
a full scheduling run (flows/schedule.py) of the same workload file (``--workload``, the
files of bench/sched.py), and ``tasks/sched/simulator.py`` runs the same policy object on
the same workload, sizes and seed, so every mode has a live figure and a predicted one.

The mapping, live <-> simulator (``tasks.sched.config.paced_workload``):

- one live *group* (``rollout.group_size`` sessions of one task, which GRPO needs
  together) is one simulated *rollout*: the coordinator counts groups on both sides;
- the simulator's ``cap`` (rollouts per cell) is ``scheduler.groups_per_cell``, its
  ``batch`` is ``rollout.groups_per_step``, ``cells`` and ``steps`` are the live ones (the
  file's sizes give way; its times, growth and bursts stay);
- every time of the file (median, timeout, call interval, training per sample, DP sync,
  weight load, role change, tick) is multiplied by ``--time-scale`` (live seconds per
  workload second);
- group ``i`` (start order) holds its slot for ``Durations(w, seed)[i]``, the simulator's
  rollout ``i``: each of its sessions makes a real model call through the gateway at the
  start of every ``call_s`` (the ends of calls are where a withdrawn cell's sessions move)
  and its environment steps wait for the next interval (tasks/rollout.py ``SlowEnv``);
- a step over ``m`` members on ``b`` groups takes the simulator's step time (at least:
  ``tasks.train.dp.StepPlan.pace_s``, from each member's start); a weight load at least
  ``weight_load_s``, a move to train ``switch_s`` after its drain, a move to rollout
  ``switch_s + weight_load_s`` (infra/cells/executor.py).
Everything else is real and costs what it costs: Prefect task starts, Dask resources,
gateway withdrawal with KV moves to the coordinator's reroute targets, weight loads over
the engines' HTTP API, checkpoints in the store, DP group formation and gloo all-reduce,
TITO, processing. Those costs are what the live/sim ratio measures (``overheads``).

All modes train under the same lag bound (``train.max_staleness``). Async runs at the split
chosen in advance (the best streaming split on the workload's first hour, as bench/sched.py
picks it: ``Workload.frozen_at_start``) and at the simulator's best split in hindsight and
its neighbours (live best of those is "async best"). Throughput: groups trained per second
from the first decision to the last step's end, on both sides.

    python bench/modes.py --workload bench/workloads/growth.yaml [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import secrets
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_WORKLOAD = os.path.join(HERE, "workloads", "growth.yaml")
if not os.path.exists(DEFAULT_WORKLOAD):
    DEFAULT_WORKLOAD = os.path.join(HERE, "workloads", "reference.yaml")

# the engines' own pace (a call's decode): far below a call interval, so a session's slot
# time is the workload's, whatever the model does in it
ENGINE_PACING = {"decode_step_s": 0.01, "prefill_tokens_per_s": 20000.0}


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every mode of one bench shares."""

    workload: str
    cells: int
    cap: int  # groups per rollout cell (the simulator's cap)
    batch: int  # groups per step (the simulator's batch)
    steps: int
    time_scale: float
    call_s: float  # workload seconds between model calls (0: the file's)
    seed: int
    store: str

    def file_workload(self):
        from tasks.sched.workload import load_workload

        w = load_workload(self.workload)
        if self.call_s:
            w = dataclasses.replace(w, call_s=self.call_s)
        return w


def overrides(st: Setup, mode: str, rollout_cells: int, wfile: str) -> list[str]:
    """The run config of one mode: everything but the mode (and async's split) is shared.

    The scheduler's cost estimates, marks, core and dwell are what tasks/sched/presets.py
    gives the simulated policy for this workload, scaled."""
    from tasks.sched import presets
    from tasks.sched.modes import Elastic, core_cells

    w = st.file_workload()
    k = st.time_scale
    marks = presets.elastic_marks(w)
    tick = max(0.1, w.tick_s * k)
    o = [
        f"store={st.store}",
        f"train.steps={st.steps}",
        "train.max_staleness=1",
        "train.stale_policy=drop",
        "train.lr=0.001",
        f"rollout.groups_per_step={st.batch}",
        "rollout.group_size=2",
        "rollout.subtasks=1",
        "rollout.max_new_tokens=4",
        "rollout.max_attempts=1",
        f"rollout.timeout_s={w.timeout_s * k + 60:.3f}",  # the paced cut comes first
        f"cluster.rollout_cells={rollout_cells}",
        f"cluster.train_cells={st.cells - rollout_cells}",
        f"scheduler.mode={mode}",
        f"scheduler.groups_per_cell={st.cap}",
        f"scheduler.core={core_cells(st.cells, presets.CORE_FRAC)}",
        f"scheduler.low_mark={marks.low * k:.4f}",
        f"scheduler.high_mark={marks.high * k:.4f}",
        f"scheduler.min_dwell_s={Elastic.min_dwell_s * k:.4f}",
        f"scheduler.train_s_per_group={w.train_s_per_sample * k:.4f}",
        f"scheduler.dp_sync_s={w.dp_sync_s * k:.4f}",
        f"scheduler.tick_s={tick:.4f}",
        f"scheduler.seed={st.seed}",
        f"scheduler.pacing.workload={wfile}",
        f"scheduler.pacing.time_scale={k}",
    ]
    return o + [f"scheduler.pacing.{kk}={v}" for kk, v in ENGINE_PACING.items()]


def predict(cfg, costs: dict[str, float] | None = None) -> dict[str, float]:
    """The simulator on exactly this run: the policy the flow builds, the paced workload;
    ``costs``: workload costs replaced by what the live run measured (``measured_costs``)."""
    from tasks.sched.config import build_policy, coordinator_args, paced_workload
    from tasks.sched.simulator import Simulator

    sc, r = cfg.scheduler, cfg.rollout
    n = cfg.cluster.rollout_cells + cfg.cluster.train_cells
    w = paced_workload(
        sc.pacing, cells=n, cap=sc.groups_per_cell, batch=r.groups_per_step,
        steps=cfg.train.steps, tick_s=sc.tick_s,
    )  # fmt: skip
    pol = build_policy(
        sc, n_cells=n, rollout_cells=cfg.cluster.rollout_cells, batch=r.groups_per_step,
        max_lag=cfg.train.max_staleness, timeout_s=r.timeout_s,
    )  # fmt: skip
    if costs:
        w = dataclasses.replace(w, **costs)
    sim = Simulator(pol, w, seed=sc.seed)
    for k, v in coordinator_args(sc.pacing).items():  # as the flow builds its coordinator
        setattr(sim.coord, k, v)
    m = sim.run()
    return {
        "groups_per_s": m["samples_per_hour"] / 3600.0,
        "seconds": m["hours"] * 3600.0,
        "lag_mean": m["lag_mean"],
        "lag_max": m["lag_max"],
        "idle": m["idle_fraction"],
        "switches": m["role_switches"],
        "migrations": m["migrations"],
        "wasted_switches": m.get("wasted_switches", 0.0),
        "broken": m["sessions_broken"],
    }


def _cpu_children() -> float:
    """CPU seconds of this process's live children (the cells, the Prefect server)."""
    import psutil

    tot = 0.0
    for c in psutil.Process().children(recursive=True):
        try:
            t = c.cpu_times()
            tot += t.user + t.system
        except psutil.Error:
            pass
    return tot


def run_mode(cells, st_obj, model_dir: str, cfg, run_id: str) -> dict[str, Any]:
    """One scheduling run on the shared cells; returns its live figures."""
    from prefect_dask import DaskTaskRunner

    from flows import live
    from flows.schedule import schedule
    from infra.gateway.gateway import Gateway
    from storage.checkpoints import publish_checkpoint
    from storage.sql import query
    from tasks.sched.config import paced_workload
    from tasks.sched.workload import Durations

    publish_checkpoint(st_obj, run_id, model_dir, 0)
    gw = Gateway(
        st_obj,
        run_id=run_id,
        tokenizer_dir=model_dir,
        admin_token=secrets.token_urlsafe(16),
        spool_dir=os.path.join(os.environ.get("GYRE_BENCH_SPOOL", "/tmp/gyre-bench"), run_id),
    )
    gw.start()
    live.register(run_id, cells, gw, model_dir)
    ru0, ch0, w0 = resource.getrusage(resource.RUSAGE_SELF), _cpu_children(), time.monotonic()
    try:
        out = schedule.with_options(task_runner=DaskTaskRunner(address=cells.scheduler_address))(
            run_id, cfg, st_obj, 0
        )
        gstats = gw.stats()
    finally:
        live.drop(run_id)
        gw.stop()
    ru1, ch1, wall = (
        resource.getrusage(resource.RUSAGE_SELF),
        _cpu_children(),
        time.monotonic() - w0,
    )
    rid = run_id
    steps = query(
        st_obj,
        f"SELECT step, tokens, lag_mean, lag_max, n_members, dropped_tokens, t_end "
        f"FROM steps WHERE run_id = '{rid}' ORDER BY step",
    ).to_pylist()
    failed = query(
        st_obj, f"SELECT count(*) AS n FROM scores WHERE run_id = '{rid}' AND status = 'failed'"
    ).to_pylist()[0]["n"]
    dup = query(
        st_obj,
        f"SELECT count(*) AS n FROM (SELECT sample_id FROM ledger WHERE run_id = '{rid}' "
        f"GROUP BY 1 HAVING count(*) > 1)",
    ).to_pylist()[0]["n"]
    moves = move_costs(
        query(
            st_obj,
            f"SELECT event, role, seconds, wait_s, drain_s, park_s, start_s, load_s, "
            f"dispatch_s, form_s, sync_s, train_s, commit_s FROM cells "
            f"WHERE run_id = '{rid}' AND event IN ('role', 'load_weights', 'step_done')",
        ).to_pylist()
    )
    stats = out["stats"]
    sc, r = cfg.scheduler, cfg.rollout
    n = cfg.cluster.rollout_cells + cfg.cluster.train_cells
    w = paced_workload(
        sc.pacing, cells=n, cap=sc.groups_per_cell, batch=r.groups_per_step,
        steps=cfg.train.steps, tick_s=sc.tick_s,
    )  # fmt: skip
    dur = Durations(w, sc.seed)
    t0 = out["t0_wall"]
    end = max(s["t_end"] for s in steps) - t0
    tok = sum(s["tokens"] for s in steps) or 1
    groups = len(steps) * r.groups_per_step
    # where the time went beyond the paced costs
    gt = [g for g in out["group_times"] if g[2] > 0]
    slot_over = [g[2] - g[1] - dur[g[0]] for g in gt]  # rollout task end - start - paced
    proc = [g[3] - g[2] for g in gt if g[3] > 0]  # processing before the finish event
    fin = [g[3] - g[1] - dur[g[0]] for g in gt if g[3] > 0]  # the finish event's delay
    step_over = [s - p for s, p in zip(stats.step_s, stats.step_pace_s, strict=False)]
    # cell time: a rollout cell is busy with its booked slots, a train cell inside steps
    held = (
        sum(min(g[3] if g[3] > 0 else t0 + end, t0 + end) - g[1] for g in gt) / sc.groups_per_cell
    )
    rows = out["report"]["rows"]
    span = out["seconds"]
    in_roles = sum((x["rollout"] + x["train"]) * span for x in rows)
    in_steps = sum(x["in_steps"] * span for x in rows)
    idle = max(0.0, in_roles - held - in_steps) / max(1e-9, n * span)
    # the executor's costs as the simulator's workload costs (live seconds)
    to_roll = [x for x, to in zip(stats.switch_latency_s, stats.switch_to, strict=False)
               if to == "rollout"]  # fmt: skip
    load = statistics.fmean(stats.load_s) if stats.load_s else w.weight_load_s
    load = max(load, w.weight_load_s)
    costs = {
        "finish_delay_s": max(0.0, statistics.fmean(fin)) if fin else 0.0,
        "step_overhead_s": max(0.0, statistics.fmean(step_over)) if step_over else 0.0,
        "weight_load_s": load,
        "switch_s": max(w.switch_s, statistics.fmean(to_roll) - load) if to_roll else w.switch_s,
    }
    cpu_self = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    lat = sorted(stats.switch_latency_s)
    return {
        "wasted_switches": wasted_switches(out.get("timeline", [])),
        "seconds": end,
        "groups_per_s": groups / end,
        "lag_mean": sum((s["lag_mean"] or 0) * s["tokens"] for s in steps) / tok,
        "lag_max": max((s["lag_max"] or 0 for s in steps), default=0),
        "idle": idle,
        "dropped_tokens": sum(s["dropped_tokens"] or 0 for s in steps),
        "max_members": max((s["n_members"] for s in steps), default=0),
        "switches": stats.switches,
        "sessions_rerouted": stats.sessions_rerouted,
        "kv_moved": stats.kv_moved,
        "reprefills": stats.reprefills,
        "weight_loads": stats.weight_loads,
        "switch_latency_s": lat[len(lat) // 2] if lat else 0.0,
        "failed_calls": int(gstats["gateway/errors"]) + int(failed),
        "ledger_duplicates": int(dup),
        "measured_costs": costs,
        "move_costs": moves,
        "overheads": {
            "slot_s_mean": statistics.fmean(slot_over) if slot_over else 0.0,
            "process_s_mean": statistics.fmean(proc) if proc else 0.0,
            "step_s_mean": statistics.fmean(step_over) if step_over else 0.0,
            "step_s": [round(x, 3) for x in step_over],
            "bench_cpu_cores": cpu_self / wall,  # flow, gateway, coordinator, executor
            "cells_cpu_cores": (ch1 - ch0) / wall,  # harnesses, engines, trainers, Prefect
            "loadavg_1m": os.getloadavg()[0],
            # the scheduling loop's own seconds by decision / event kind (Stats.loop_s)
            "loop_s": {k: round(v, 3) for k, v in getattr(stats, "loop_s", {}).items()},
            "loop_n": dict(getattr(stats, "loop_n", {})),
            # a group's end off the loop (Stats.off_loop_s): rollout_end, processed
            "off_loop_s": {k: round(v, 3) for k, v in getattr(stats, "off_loop_s", {}).items()},
            # Prefect submits on their own thread: seconds, seconds queued, count per kind
            "submits": out.get("submits", {}),
        },
    }


def move_costs(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median and max seconds of each part of the executor's actions, from the ``cells``
    rows (storage/schemas.py): moves to train and to rollout, decided weight loads, steps."""
    kind = {("role", "train"): "to_train", ("role", "rollout"): "to_rollout"}
    out: dict[str, dict[str, float]] = {}
    parts = ("seconds", "wait_s", "drain_s", "park_s", "start_s", "load_s")
    parts += ("dispatch_s", "form_s", "sync_s", "train_s", "commit_s")  # step_done rows
    for name in ("to_train", "to_rollout", "load_weights", "step_done"):
        mine = [x for x in rows if kind.get((x["event"], x["role"]), x["event"]) == name]
        for p in parts:
            xs = sorted(x[p] for x in mine if x.get(p) is not None)
            if xs:
                out.setdefault(name, {"n": len(mine)})
                out[name][f"{p}_median"] = xs[len(xs) // 2]
                out[name][f"{p}_max"] = xs[-1]
    return out


def wasted_switches(timeline: list[dict[str, Any]]) -> int:
    """Both moves of every cell recruited to training and sent back without joining a step
    (as the simulator counts them)."""
    out, recruited = 0, {}
    for e in sorted(timeline, key=lambda e: e["t"]):
        c = e["cell"]
        if e["event"] == "decide" and e["role"] == "draining":
            recruited[c] = False
        elif e["event"] == "step":
            recruited[c] = True
        elif e["event"] == "decide" and e["role"] == "loading" and recruited.get(c) is False:
            out += 2
            recruited.pop(c)
    return out


def choose_splits(st: Setup, quick: bool) -> tuple[int, int, dict[int, float], list[int]]:
    """(advance split, the simulator's best split, sim groups/s by split, splits run live).

    Advance: the best streaming split on the pilot of ``tasks.sched.presets.pilot`` (the
    workload's first hour, no growth, no bursts, ``PILOT_STEPS`` steps whatever ``--steps``),
    the rule bench/sched.py uses; best: the simulator's best on the whole run, this seed."""
    import tempfile

    from flows.config import load_config
    from tasks.sched import presets

    w = st.file_workload()
    pilot = dataclasses.replace(presets.pilot(w), name=f"{w.name}-pilot")
    pilot_st = dataclasses.replace(st, steps=presets.PILOT_STEPS)  # the run's sizes, 16 steps
    tmp = tempfile.mkdtemp(prefix="gyre-bench-modes-wl-")
    files = {}
    for name, ww in (("run", w), ("pilot", pilot)):
        path = os.path.join(tmp, f"{name}.json")
        with open(path, "w") as fh:
            json.dump(ww.to_dict(), fh)
        files[name] = path

    def sim(k: int, wfile: str, setup: Setup = st) -> float:
        cfg = load_config(overrides=overrides(setup, "async-stream", k, wfile))
        return predict(cfg)["groups_per_s"]

    splits = range(1, st.cells)
    by_run = {k: sim(k, files["run"]) for k in splits}
    by_pilot = {k: sim(k, files["pilot"], pilot_st) for k in splits}
    k_adv = max(by_pilot, key=lambda k: (by_pilot[k], k))
    k_best = max(by_run, key=lambda k: (by_run[k], k))
    live = [k_adv, k_best] if quick else [k_adv, k_best - 1, k_best, k_best + 1]
    live = sorted({k for k in live if 1 <= k < st.cells})
    return k_adv, k_best, by_run, live


def bench(st: Setup, quick: bool, only: tuple[str, ...] = ()) -> dict[str, Any]:
    from prefect import flow
    from prefect.client.orchestration import get_client

    from flows.config import load_config
    from infra.cells.cluster import default_worker_env, start_cells
    from infra.engine.tiny_model import make_tiny_model
    from storage.store import Store

    k_adv, k_best, sim_by_split, splits = choose_splits(st, quick)
    print(
        f"async splits: advance {k_adv}, simulator's best {k_best}; live at {splits}",
        file=sys.stderr,
        flush=True,
    )
    stamp = time.strftime("%H%M%S")
    wfile = os.path.abspath(st.workload)
    if st.call_s:
        import tempfile

        wfile = os.path.join(tempfile.mkdtemp(prefix="gyre-bench-modes-wl-"), "run.json")
        with open(wfile, "w") as fh:
            json.dump(st.file_workload().to_dict(), fh)

    @flow(name="bench-modes")
    def _bench() -> dict[str, Any]:
        with get_client(sync_client=True) as client:
            api = str(client.api_url).rstrip("/")
        env = {**default_worker_env(), "PREFECT_API_URL": api}
        model_dir = make_tiny_model()
        store = Store(st.store)
        res: dict[str, Any] = {}
        with start_cells(
            st.cells, threads_per_cell=2, env=env, rollout_slots=2, harness_slots=st.cap
        ) as cells:
            plan = [("colocate", st.cells - 1)]
            plan += [("async-stream", k) for k in splits]
            plan.append(("elastic", st.cells - 1))
            if only:  # an experiment on some modes (figures need all four)
                plan = [(m, k) for m, k in plan if m in only or m.split("-")[0] in only]
            for mode, k in plan:
                name = mode if mode != "async-stream" else f"async-{k}R{st.cells - k}T"
                cfg = load_config(overrides=overrides(st, mode, k, wfile))
                t0 = time.monotonic()
                sim = predict(cfg)
                res[name] = run_mode(cells, store, model_dir, cfg, f"bench-{stamp}-{name}")
                res[name]["sim_paced"] = sim  # the paced costs only: a prediction
                res[name]["live_over_sim_paced"] = res[name]["groups_per_s"] / sim["groups_per_s"]
                sim = predict(cfg, res[name]["measured_costs"])  # + the executor's own costs
                res[name]["sim"] = sim
                res[name]["live_over_sim"] = res[name]["groups_per_s"] / sim["groups_per_s"]
                res[name]["rollout_cells"] = k
                print(
                    f"  {name}: live {res[name]['groups_per_s']:.4f} groups/s, sim "
                    f"{sim['groups_per_s']:.4f} (x{res[name]['live_over_sim']:.2f}), lag "
                    f"{res[name]['lag_mean']:.2f}/{res[name]['lag_max']} "
                    f"({time.monotonic() - t0:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
        return res

    res = _bench()
    return {"modes": res, "k_adv": k_adv, "k_best_sim": k_best, "sim_by_split": sim_by_split}


def figures(b: dict[str, Any], st: Setup) -> dict[str, Any]:
    res = b["modes"]
    asyncs = {k: v for k, v in res.items() if k.startswith("async")}
    adv = next(k for k, v in asyncs.items() if v["rollout_cells"] == b["k_adv"])
    best = max(asyncs, key=lambda k: asyncs[k]["groups_per_s"])
    e, c, a = res["elastic"], res["colocate"], res[adv]
    ratios = [v["live_over_sim"] for v in res.values()]
    paced = [v["live_over_sim_paced"] for v in res.values()]

    def sim_ratio(x, y):
        return x["sim"]["groups_per_s"] / y["sim"]["groups_per_s"]

    over = [v["overheads"] for v in res.values()]
    return {
        "live_over_sim_min": min(ratios),
        "live_over_sim_max": max(ratios),
        "live_over_sim_paced_min": min(paced),
        "live_over_sim_paced_max": max(paced),
        "live_over_sim_elastic": e["live_over_sim"],
        "live_elastic_over_async_advance": e["groups_per_s"] / a["groups_per_s"],
        "live_elastic_over_async_best": e["groups_per_s"] / res[best]["groups_per_s"],
        "live_elastic_over_colocate": e["groups_per_s"] / c["groups_per_s"],
        "sim_elastic_over_async_advance": sim_ratio(e, a),
        "sim_elastic_over_async_best": sim_ratio(e, res[best]),
        "sim_elastic_over_colocate": sim_ratio(e, c),
        "lag_elastic": e["lag_mean"],
        "lag_async": a["lag_mean"],
        "lag_colocate": c["lag_mean"],
        "lag_max_elastic": e["lag_max"],
        "lag_max_async": a["lag_max"],
        "lag_bound": 1,
        "async_split_advance": adv,
        "async_split_best": best,
        "async_split_best_sim": b["k_best_sim"],
        "switches": e["switches"],
        "wasted_switches": e["wasted_switches"],
        "wasted_over_switches": e["wasted_switches"] / max(1, e["switches"]),
        "elastic_move_costs": e["move_costs"],
        "sessions_rerouted": e["sessions_rerouted"],
        "kv_moved": e["kv_moved"],
        "failed_calls": sum(v["failed_calls"] for v in res.values()),
        "ledger_duplicates": sum(v["ledger_duplicates"] for v in res.values()),
        "bench_cpu_cores": max(o["bench_cpu_cores"] for o in over),
        "cells_cpu_cores": max(o["cells_cpu_cores"] for o in over),
        "by_mode": res,
        "modes": {"colocate": "colocate", "async_advance": adv, "async_best": best},
        "sim_by_split": b["sim_by_split"],
        "setup": dataclasses.asdict(st),
        "engine_pacing": ENGINE_PACING,
    }


COLS = (
    ("groups_per_s", "live groups/s", "{:.4f}"),
    (("sim", "groups_per_s"), "sim groups/s", "{:.4f}"),
    ("live_over_sim", "live/sim", "{:.2f}"),
    (("sim_paced", "groups_per_s"), "sim paced", "{:.4f}"),
    ("live_over_sim_paced", "live/paced", "{:.2f}"),
    ("seconds", "live s", "{:.0f}"),
    (("sim", "seconds"), "sim s", "{:.0f}"),
    ("lag_mean", "lag", "{:.2f}"),
    ("lag_max", "lag max", "{}"),
    ("idle", "idle", "{:.2f}"),
    (("sim", "idle"), "sim idle", "{:.2f}"),
    ("switches", "switches", "{}"),
    (("sim", "switches"), "sim sw", "{:.0f}"),
    ("wasted_switches", "wasted", "{}"),
    (("sim", "wasted_switches"), "sim wasted", "{:.0f}"),
    ("sessions_rerouted", "rerouted", "{}"),
    ("kv_moved", "KV moves", "{}"),
    ("failed_calls", "failed", "{}"),
    (("overheads", "slot_s_mean"), "slot +s", "{:.2f}"),
    (("overheads", "process_s_mean"), "process s", "{:.2f}"),
    (("overheads", "step_s_mean"), "step +s", "{:.2f}"),
    (("measured_costs", "switch_s"), "switch s", "{:.2f}"),
    (("measured_costs", "weight_load_s"), "load s", "{:.2f}"),
)


def _get(v: dict, k):
    return v[k[0]][k[1]] if isinstance(k, tuple) else v[k]


def table(res: dict[str, Any]) -> str:
    head = "| mode | " + " | ".join(c[1] for c in COLS) + " |"
    sep = "| --- | " + " | ".join("---:" for _ in COLS) + " |"
    rows = [
        f"| {m} | " + " | ".join(fmt.format(_get(v, k)) for k, _, fmt in COLS) + " |"
        for m, v in res.items()
    ]
    return "\n".join([head, sep, *rows])


KEYS = (
    "live_over_sim_elastic",
    "live_over_sim_min",
    "live_over_sim_max",
    "live_over_sim_paced_min",
    "live_over_sim_paced_max",
    "live_elastic_over_async_advance",
    "sim_elastic_over_async_advance",
    "live_elastic_over_async_best",
    "sim_elastic_over_async_best",
    "live_elastic_over_colocate",
    "sim_elastic_over_colocate",
    "lag_elastic",
    "lag_async",
    "switches",
    "wasted_switches",
    "wasted_over_switches",
    "failed_calls",
    "bench_cpu_cores",
    "cells_cpu_cores",
)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default=DEFAULT_WORKLOAD, help="a workload file")
    ap.add_argument("--quick", action="store_true", help="fewer steps, async at two splits")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--cells", type=int, default=8)
    ap.add_argument("--cap", type=int, default=2, help="groups per rollout cell")
    ap.add_argument("--batch", type=int, default=0, help="groups per step (0: cells x cap)")
    ap.add_argument("--steps", type=int, default=0, help="0: 8 (--quick: 3)")
    ap.add_argument(
        "--time-scale", type=float, default=1 / 240, help="live seconds per workload second"
    )
    ap.add_argument(
        "--call-s",
        type=float,
        default=600.0,
        help="workload seconds between a session's model calls, replacing the file's (0: the "
        "file's); 600 at 1/240 is a call every 2.5 s live",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="run only these modes (comma-separated)")
    ap.add_argument("--store", default=None, help="default: a fresh temp directory")
    args = ap.parse_args(argv)
    import tempfile

    st = Setup(
        workload=args.workload,
        cells=args.cells,
        cap=args.cap,
        batch=args.batch or args.cells * args.cap,
        steps=args.steps or (3 if args.quick else 8),
        time_scale=args.time_scale,
        call_s=args.call_s,
        seed=args.seed,
        store=args.store or tempfile.mkdtemp(prefix="gyre-bench-modes-"),
    )
    t0 = time.monotonic()
    b = bench(st, args.quick, tuple(x for x in args.only.split(",") if x))
    print(table(b["modes"]))
    if args.only:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(b, fh, indent=2, default=float)
        return b
    fig = figures(b, st)
    print()
    for k in KEYS:
        v = fig[k]
        print(f"{k:34s} {v:.3f}" if isinstance(v, float) else f"{k:34s} {v}")
    fig["wall_s"] = time.monotonic() - t0
    print(
        f"(async advance split {fig['async_split_advance']}, best live {fig['async_split_best']}"
        f", best sim {fig['async_split_best_sim']}; store {st.store}; {fig['wall_s']:.0f}s wall;"
        " one run per mode)"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(fig, fh, indent=2, default=float)
    return fig


if __name__ == "__main__":
    main()
