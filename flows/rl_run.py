"""The RL run: cells of a Dask cluster, an engine per rollout cell, a gateway, and the loop.

``rl_run`` owns the run's machinery (config, store, model, cells, gateway); the loop itself
is the scheduling flow (flows/schedule.py): the same Coordinator and policies as the
simulator decide, for ``scheduler.mode`` colocate, async or elastic, which cells roll out
and which train, and its executor carries that out while rollouts stream to processing and
data-parallel steps publish new weights. Trigger it with ``gyre run`` or from the Prefect
UI (deployment in prefect.yaml).
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.logging import get_run_logger
from prefect_dask import DaskTaskRunner

from flows import live
from flows.config import RunConfig, load_config
from flows.preflight import preflight
from flows.schedule import schedule
from infra.cells.cluster import default_worker_env, start_cells
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.gateway import Gateway
from storage.checkpoints import latest_version, publish_checkpoint
from storage.paths import spool_dir
from storage.sql import query
from storage.store import Store

log = logging.getLogger(__name__)


def new_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def _totals(store: Store, run_id: str) -> dict[str, Any]:
    """What the run produced, read back from the store (what a user's SQL would see)."""
    rid = run_id.replace("'", "''")
    out: dict[str, Any] = {}
    for sql in (
        f"SELECT count(*) AS calls FROM tito WHERE run_id = '{rid}'",
        f"SELECT coalesce(sum(n_tokens_unique), 0) AS tokens_unique, "
        f"coalesce(sum(n_tokens_flat), 0) AS tokens_flat, "
        f"coalesce(avg(reward), 0) AS mean_reward FROM rollouts WHERE run_id = '{rid}'",
        f"SELECT coalesce(sum(tokens), 0) AS tokens_trained, "
        f"arg_max(loss, step) AS final_loss, avg(lag_mean) AS lag_mean, "
        f"max(lag_max) AS lag_max, max(n_members) AS max_members "
        f"FROM steps WHERE run_id = '{rid}'",
    ):
        out.update(query(store, sql).to_pylist()[0])
    # DuckDB sums integers to DECIMAL: plain numbers for the summary and the artifact
    return {
        k: (float(v) if hasattr(v, "as_integer_ratio") and not isinstance(v, int) else v)
        for k, v in out.items()
    }


@flow(name="rl_run", flow_run_name="{preset}-run")
def rl_run(
    preset: str | None = "tiny",
    overrides: list[str] | None = None,
    store: str | None = None,
    config_file: str | None = None,
) -> dict[str, Any]:
    """One RL run of the bundled environment: validated config, cells, engines, gateway, loop."""
    cfg: RunConfig = load_config(
        config_file=config_file, preset=preset, overrides=overrides or [], store=store
    )
    preflight(cfg)  # a deployment run checks the world too, before anything starts
    logger = get_run_logger()
    run_id = cfg.run_id or new_run_id()
    st = Store(cfg.store)
    t0 = time.monotonic()
    model_dir = cfg.model.path or make_tiny_model(seed=cfg.model.seed)
    version = latest_version(st, run_id)
    if version is None:
        publish_checkpoint(st, run_id, model_dir, 0)
        version = 0
    logger.info("run %s: store %s, model %s, starting at v%d", run_id, st.url, model_dir, version)

    with get_client(sync_client=True) as client:
        api_url = client.api_url
    env = {
        **default_worker_env(),
        "PREFECT_API_URL": str(api_url).rstrip("/"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    sc = cfg.scheduler
    n_cells = cfg.cluster.rollout_cells + cfg.cluster.train_cells
    admin_token = secrets.token_urlsafe(24)
    with start_cells(
        n_cells,
        threads_per_cell=cfg.cluster.threads_per_cell,
        memory_limit=cfg.cluster.memory_limit,
        scheduler_address=cfg.cluster.scheduler_address,
        env=env,
        rollout_slots=sc.groups_per_cell,
        harness_slots=sc.groups_per_cell,
    ) as cells:
        # the write-ahead log of answered calls lives where a later process can replay it
        gateway = Gateway(
            st,
            run_id=run_id,
            tokenizer_dir=model_dir,
            admin_token=admin_token,
            port=cfg.gateway.port,
            spool_dir=str(spool_dir(st.url, run_id)),
        )
        gateway.start()
        logger.info("cells and gateway up in %.1fs", time.monotonic() - t0)
        try:
            live.register(run_id, cells, gateway, model_dir)
            runner = DaskTaskRunner(address=cells.scheduler_address)
            loop = schedule.with_options(task_runner=runner)(run_id, cfg, st, version)
        finally:
            live.drop(run_id)
            gateway.stop()

    stats = loop["stats"]
    lat = sorted(stats.switch_latency_s)
    summary = {
        "run_id": run_id,
        "store": st.url,
        "mode": sc.mode,
        "steps": stats.steps,
        "weight_version": loop["weight_version"],
        **_totals(st, run_id),
        "switches": stats.switches,
        "sessions_rerouted": stats.sessions_rerouted,
        "kv_moved": stats.kv_moved,
        "switch_latency_s": round(lat[len(lat) // 2], 3) if lat else None,
        "report": loop["report"]["dir"],
        "seconds": round(time.monotonic() - t0, 1),
    }
    create_markdown_artifact(
        key="rl-run-summary",
        markdown="\n".join(
            ["| metric | value |", "| --- | --- |"]
            + [f"| {k} | {v} |" for k, v in summary.items()]
            + ["", f'Query it: `gyre sql --store {st.url} "SELECT * FROM steps"`']
        ),
        description=f"gyre run {run_id}",
    )
    logger.info("summary: %s", summary)
    return summary
