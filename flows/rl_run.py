"""The RL run: rollout -> process -> train -> publish, on cells of a Dask cluster.

``rl_run`` owns the run's machinery (config, store, cells, engines, gateway);
``rl_loop`` is the loop itself, a subflow whose tasks run on the cells through
Prefect's DaskTaskRunner. Trigger it with ``gyre run`` or from the Prefect UI
(deployment in prefect.yaml).
"""

from __future__ import annotations

import logging
import secrets
import sys
import time
from typing import Any

import dask
from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.logging import get_run_logger
from prefect_dask import DaskTaskRunner
from tqdm import tqdm

from flows import live
from flows.config import RunConfig, load_config
from flows.preflight import preflight
from infra.cells.cluster import default_worker_env, start_cells
from infra.cells.engines import load_weights, start_engine
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.gateway import Gateway
from storage.checkpoints import latest_version, publish_checkpoint
from storage.paths import spool_dir
from storage.store import Store
from tasks.handles import ProcessedStep, TrainedStep
from tasks.process import process_step
from tasks.rollout import rollout_group
from tasks.train_step import train_step

log = logging.getLogger(__name__)

CLOCK_SKEW_NS = 300 * 10**9


def new_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def _cell_event(
    store: Store,
    run_id: str,
    cell_id: str,
    event: str,
    role: str,
    version: int = -1,
    detail: str = "",
) -> None:
    store.append(
        "cells",
        [
            {
                "run_id": run_id,
                "cell_id": cell_id,
                "event": event,
                "role": role,
                "weight_version": version,
                "t": time.time(),
                "detail": detail,
            }
        ],
    )


@flow(name="rl_loop", flow_run_name="{run_id}-loop")
def rl_loop(
    run_id: str,
    cfg: RunConfig,
    store: Store,
    start_version: int,
) -> dict[str, Any]:
    """steps x (rollout groups -> process -> train step -> publish weights to rollout cells)."""
    logger = get_run_logger()
    cells, gateway = live.lookup(run_id)
    rcfg, tcfg = cfg.rollout, cfg.train
    version = start_version
    history: list[tuple[ProcessedStep, TrainedStep]] = []
    bar = tqdm(
        range(tcfg.steps),
        desc=f"gyre {run_id}",
        unit="step",
        file=sys.stderr,
    )
    for step in bar:
        bar.set_postfix_str(f"v{version} rollout")
        # segments of this step's sessions are written after this; the margin covers
        # clock skew between hosts (reading a few older segments is harmless)
        since_ns = time.time_ns() - CLOCK_SKEW_NS
        with dask.annotate(resources={"rollout": 1}):
            futures = [
                rollout_group.submit(
                    gateway.url,
                    gateway.admin_token,
                    store,
                    run_id,
                    step,
                    f"s{step}-g{g}",
                    rcfg.seed * 1_000_003 + step * 1009 + g,
                    rcfg,
                )
                for g in range(rcfg.groups_per_step)
            ]
        sessions = [h for f in futures for h in f.result()]
        gateway.flush()  # every answered call is in the store before processing
        bar.set_postfix_str(f"v{version} process")
        processed = process_step.submit(
            store, run_id, step, sessions, version, tcfg, since_ns
        ).result()
        bar.set_postfix_str(f"v{version} train")
        with dask.annotate(resources={"train": 1}):
            trained = train_step.submit(
                store, run_id, step, processed.samples_segment, tcfg
            ).result()
        version = trained.weight_version
        for addr in cells.with_role("rollout"):
            cells.run_on(addr, load_weights, store, run_id, version)
            _cell_event(store, run_id, cells.cell_id(addr), "load_weights", "rollout", version)
        history.append((processed, trained))
        bar.set_postfix_str(
            f"v{version} reward {processed.reward_mean:.3f} "
            f"loss {trained.metrics['train/loss']:.4f}"
        )
        logger.info(
            "step %d done: v%d published to %d rollout cells",
            step,
            version,
            len(cells.with_role("rollout")),
        )
    bar.close()
    return {"steps": history, "weight_version": version}


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
    n_cells = cfg.cluster.rollout_cells + cfg.cluster.train_cells
    admin_token = secrets.token_urlsafe(24)
    with start_cells(
        n_cells,
        threads_per_cell=cfg.cluster.threads_per_cell,
        memory_limit=cfg.cluster.memory_limit,
        scheduler_address=cfg.cluster.scheduler_address,
        env=env,
    ) as cells:
        addrs = sorted(cells.roles)
        for i, addr in enumerate(addrs):
            role = "rollout" if i < cfg.cluster.rollout_cells else "train"
            cells.set_role(addr, role)
            _cell_event(st, run_id, cells.cell_id(addr), "join", role, version)
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
        try:
            for addr in cells.with_role("rollout"):
                cid = cells.cell_id(addr)
                url = cells.run_on(
                    addr,
                    start_engine,
                    model_dir,
                    cell_id=cid,
                    weight_version=version,
                    max_batch_size=cfg.model.max_batch_size,
                    kv_cache_tokens=cfg.model.kv_cache_tokens,
                    audit_dir=cfg.model.audit_dir,
                )
                if version > 0:
                    cells.run_on(addr, load_weights, st, run_id, version)
                gateway.add_engine(cid, url)
                _cell_event(st, run_id, cid, "engine_start", "rollout", version, url)
            logger.info(
                "cells up in %.1fs: %s",
                time.monotonic() - t0,
                ", ".join(f"{cells.cell_id(a)}={r}" for a, r in cells.roles.items()),
            )
            runner = DaskTaskRunner(address=cells.scheduler_address)
            live.register(run_id, cells, gateway)
            loop = rl_loop.with_options(task_runner=runner)(run_id, cfg, st, version)
        finally:
            live.drop(run_id)
            gateway.stop()
            for addr, role in cells.roles.items():
                _cell_event(st, run_id, cells.cell_id(addr), "leave", role, -1)

    steps = loop["steps"]
    summary = {
        "run_id": run_id,
        "store": st.url,
        "steps": len(steps),
        "weight_version": loop["weight_version"],
        "calls": sum(p.n_calls for p, _ in steps),
        "tokens_unique": sum(p.tokens_unique for p, _ in steps),
        "tokens_flat": sum(p.tokens_flat for p, _ in steps),
        "tokens_trained": int(sum(t.metrics["train/tokens"] for _, t in steps)),
        "mean_reward": (sum(p.reward_mean for p, _ in steps) / len(steps)) if steps else 0.0,
        "final_loss": steps[-1][1].metrics["train/loss"] if steps else None,
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
