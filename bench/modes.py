"""Colocate vs async vs elastic on the real stack, side by side, at equal policy lag.

One Prefect flow, one Dask LocalCluster of ``--cells`` cells reused by every mode (so no
mode pays a different start-up), the tiny model, the bundled arithmetic environment driven
by the black-box harness over the official openai client through the gateway. Each mode is
a full scheduling run (flows/schedule.py) of the same workload: group ``i`` has the same
task, length and environment delays in every mode.

What is paced (scheduler.pacing; 2 CPU cores cannot be several accelerators):
- a rollout cell's decode step takes ``decode_step_s`` for any batch up to 16 rows (one
  session gets 1/decode_step_s tokens/s, a cell up to 16/decode_step_s), prefill runs at
  ``prefill_tokens_per_s``;
- a training member spends ``train_s_per_token`` per token of its shard;
- every environment step (grading an answer, a tool) takes a log-normal time (median
  ``env_step_s``, spread ``env_step_sigma``), and rollout lengths vary across groups
  (log-normal) and grow ``length_growth`` x over the run.
Everything else is real: Dask resource changes, gateway withdrawal with live sessions
rerouted and their KV moved, weight loads through the engines' HTTP API, checkpoints in
the store, DP group formation and gradient all-reduce over gloo, TITO, processing.

All modes train under the same lag bound (``train.max_staleness``, enforced by the trainer:
tokens beyond it are dropped and counted). Async runs at every split of the cells, as the
batch pipeline and as streaming steps (``async-stream``), and the best of them is reported
(async at its best in hindsight). Throughput is groups trained per second of
the run (first decision to the last step's end).

    python bench/modes.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
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

PACING = {
    "decode_step_s": 0.03,
    "prefill_tokens_per_s": 20000.0,
    "train_s_per_token": 0.001,
    "env_step_s": 0.25,
    "env_step_sigma": 1.0,
    "length_sigma": 0.8,
    "length_growth": 3.0,
}


def overrides(mode: str, cells: int, steps: int, rollout_cells: int, store: str) -> list[str]:
    """The run config of one mode: everything but the mode (and async's split) is shared."""
    o = [
        f"store={store}",
        f"train.steps={steps}",
        "train.max_staleness=1",
        "train.stale_policy=drop",
        "train.lr=0.001",
        "rollout.groups_per_step=2",
        "rollout.group_size=2",
        "rollout.subtasks=1",
        "rollout.max_new_tokens=8",
        "rollout.max_attempts=2",
        "rollout.timeout_s=300",
        f"cluster.rollout_cells={rollout_cells}",
        f"cluster.train_cells={cells - rollout_cells}",
        f"scheduler.mode={mode}",
        "scheduler.groups_per_cell=2",
        "scheduler.core=1",
        "scheduler.low_mark=2",
        "scheduler.high_mark=6",
        "scheduler.min_dwell_s=3",
        "scheduler.train_s_per_group=1.0",
        "scheduler.dp_sync_s=0.2",
        "scheduler.tick_s=0.1",
    ]
    return o + [f"scheduler.pacing.{k}={v}" for k, v in PACING.items()]


def run_mode(cells, st, model_dir: str, cfg, run_id: str) -> dict[str, Any]:
    """One scheduling run on the shared cells; returns its figures."""
    from prefect_dask import DaskTaskRunner

    from flows import live
    from flows.schedule import schedule
    from infra.gateway.gateway import Gateway
    from storage.checkpoints import publish_checkpoint
    from storage.sql import query

    publish_checkpoint(st, run_id, model_dir, 0)
    gw = Gateway(
        st,
        run_id=run_id,
        tokenizer_dir=model_dir,
        admin_token=secrets.token_urlsafe(16),
        spool_dir=os.path.join(os.environ.get("GYRE_BENCH_SPOOL", "/tmp/gyre-bench"), run_id),
    )
    gw.start()
    live.register(run_id, cells, gw, model_dir)
    try:
        out = schedule.with_options(task_runner=DaskTaskRunner(address=cells.scheduler_address))(
            run_id, cfg, st, 0
        )
        gstats = gw.stats()
    finally:
        live.drop(run_id)
        gw.stop()
    rid = run_id
    steps = query(
        st,
        f"SELECT step, tokens, lag_mean, lag_max, n_members, dropped_tokens, t_end "
        f"FROM steps WHERE run_id = '{rid}' ORDER BY step",
    ).to_pylist()
    failed = query(
        st, f"SELECT count(*) AS n FROM scores WHERE run_id = '{rid}' AND status = 'failed'"
    ).to_pylist()[0]["n"]
    dup = query(
        st,
        f"SELECT count(*) AS n FROM (SELECT sample_id FROM ledger WHERE run_id = '{rid}' "
        f"GROUP BY 1 HAVING count(*) > 1)",
    ).to_pylist()[0]["n"]
    stats = out["stats"]
    tok = sum(s["tokens"] for s in steps) or 1
    lag_mean = sum((s["lag_mean"] or 0) * s["tokens"] for s in steps) / tok
    groups = len(steps) * cfg.rollout.groups_per_step
    ends = [s["t_end"] for s in steps]
    steady = (
        (len(ends) - 1) * cfg.rollout.groups_per_step / (ends[-1] - ends[0])
        if len(ends) > 1 and ends[-1] > ends[0]
        else 0.0
    )
    lat = sorted(stats.switch_latency_s)
    return {
        "seconds": out["seconds"],
        "groups_per_s": groups / out["seconds"],
        "steady_groups_per_s": steady,
        "lag_mean": lag_mean,
        "lag_max": max((s["lag_max"] or 0 for s in steps), default=0),
        "dropped_tokens": sum(s["dropped_tokens"] or 0 for s in steps),
        "max_members": max((s["n_members"] for s in steps), default=0),
        "switches": stats.switches,
        "sessions_rerouted": stats.sessions_rerouted,
        "kv_moved": stats.kv_moved,
        "reprefills": stats.reprefills,
        "switch_latency_s": lat[len(lat) // 2] if lat else 0.0,
        "failed_calls": int(gstats["gateway/errors"]) + int(failed),
        "ledger_duplicates": int(dup),
        "util": out["report"]["rows"],
    }


def bench(quick: bool, n_cells: int, store: str) -> dict[str, Any]:
    from prefect import flow
    from prefect.client.orchestration import get_client

    from flows.config import load_config
    from infra.cells.cluster import default_worker_env, start_cells
    from infra.engine.tiny_model import make_tiny_model
    from storage.store import Store

    steps = 3 if quick else 8
    splits = [n_cells // 2] if quick else list(range(1, n_cells))
    stamp = time.strftime("%H%M%S")

    @flow(name="bench-modes")
    def _bench() -> dict[str, Any]:
        with get_client(sync_client=True) as client:
            api = str(client.api_url).rstrip("/")
        env = {**default_worker_env(), "PREFECT_API_URL": api}
        model_dir = make_tiny_model()
        st = Store(store)
        res: dict[str, Any] = {}
        with start_cells(
            n_cells, threads_per_cell=2, env=env, rollout_slots=2, harness_slots=2
        ) as cells:
            plan = [("colocate", n_cells - 1)]
            plan += [(m, k) for m in ("async", "async-stream") for k in splits]
            plan.append(("elastic", n_cells - 1))
            for mode, k in plan:
                name = mode if not mode.startswith("async") else f"{mode}-{k}R{n_cells - k}T"
                cfg = load_config(overrides=overrides(mode, n_cells, steps, k, store))
                t0 = time.monotonic()
                res[name] = run_mode(cells, st, model_dir, cfg, f"bench-{stamp}-{name}")
                print(
                    f"  {name}: {res[name]['groups_per_s']:.3f} groups/s, lag "
                    f"{res[name]['lag_mean']:.2f}/{res[name]['lag_max']} "
                    f"({time.monotonic() - t0:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
        return res

    return _bench()


def figures(res: dict[str, Any]) -> dict[str, Any]:
    asyncs = {k: v for k, v in res.items() if k.startswith("async")}
    best = max(asyncs, key=lambda k: asyncs[k]["groups_per_s"])
    e, c, a = res["elastic"], res["colocate"], asyncs[best]
    return {
        "elastic_over_colocate": e["groups_per_s"] / c["groups_per_s"],
        "elastic_over_async": e["groups_per_s"] / a["groups_per_s"],
        "lag_elastic": e["lag_mean"],
        "lag_async": a["lag_mean"],
        "lag_colocate": c["lag_mean"],
        "lag_max_elastic": e["lag_max"],
        "lag_max_async": a["lag_max"],
        "async_best_split": best,
        "switches": e["switches"],
        "sessions_rerouted": e["sessions_rerouted"],
        "kv_moved": e["kv_moved"],
        "failed_calls": sum(v["failed_calls"] for v in res.values()),
        "switch_latency_s": e["switch_latency_s"],
        "ledger_duplicates": sum(v["ledger_duplicates"] for v in res.values()),
        "by_mode": {k: {kk: vv for kk, vv in v.items() if kk != "util"} for k, v in res.items()},
        "pacing": PACING,
    }


COLS = (
    ("groups_per_s", "groups/s", "{:.3f}"),
    ("steady_groups_per_s", "steady", "{:.3f}"),
    ("lag_mean", "lag", "{:.2f}"),
    ("lag_max", "lag max", "{}"),
    ("dropped_tokens", "dropped", "{}"),
    ("max_members", "DP max", "{}"),
    ("switches", "switches", "{}"),
    ("sessions_rerouted", "rerouted", "{}"),
    ("kv_moved", "KV moves", "{}"),
    ("switch_latency_s", "switch s", "{:.2f}"),
    ("failed_calls", "failed", "{}"),
    ("seconds", "seconds", "{:.1f}"),
)


def table(res: dict[str, Any]) -> str:
    head = "| mode | " + " | ".join(c[1] for c in COLS) + " |"
    sep = "| --- | " + " | ".join("---:" for _ in COLS) + " |"
    rows = [
        f"| {m} | " + " | ".join(fmt.format(v[k]) for k, _, fmt in COLS) + " |"
        for m, v in res.items()
    ]
    return "\n".join([head, sep, *rows])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 steps, async at one split")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--cells", type=int, default=4)
    ap.add_argument("--store", default=None, help="default: a fresh temp directory")
    args = ap.parse_args(argv)
    import tempfile

    store = args.store or tempfile.mkdtemp(prefix="gyre-bench-modes-")
    t0 = time.monotonic()
    res = bench(args.quick, args.cells, store)
    fig = figures(res)
    print(table(res))
    print()
    for k in (
        "elastic_over_colocate",
        "elastic_over_async",
        "lag_elastic",
        "lag_async",
        "switches",
        "sessions_rerouted",
        "kv_moved",
        "failed_calls",
        "switch_latency_s",
    ):
        v = fig[k]
        print(f"{k:24s} {v:.3f}" if isinstance(v, float) else f"{k:24s} {v}")
    print(
        f"(async best split: {fig['async_best_split']}; store {store}; "
        f"{time.monotonic() - t0:.0f}s wall; medians not taken: one run per mode)"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(fig, fh, indent=2, default=float)
    return fig


if __name__ == "__main__":
    main()
