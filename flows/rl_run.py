"""The RL run: cells of a Dask cluster, an engine per rollout cell, a gateway, and the loop.

``rl_run`` owns the run's machinery (config, store, model, cells, gateway); the loop itself
is the scheduling flow (flows/schedule.py): the same Coordinator and policies as the
simulator decide, for ``scheduler.mode`` colocate, async or elastic, which cells roll out
and which train, and its executor carries that out while rollouts stream to processing and
data-parallel steps publish new weights. Trigger it with ``gyre run`` or from the Prefect
UI (deployments in prefect.yaml). A run continues where it stopped with ``resume``
(``gyre run --resume RUN_ID``; flows/resume.py): the next step number, the newest committed
weights, new tasks.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Literal

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.logging import get_run_logger
from prefect.runtime import flow_run
from prefect_dask import DaskTaskRunner

from flows import live
from flows.config import PRESETS, RunConfig, load_config, preset_help
from flows.evaluation import write_learning
from flows.preflight import checked
from flows.procs import forget, record_children
from flows.progress import artifact_key, config_markdown, plain, rounded, summary_markdown
from flows.resume import new_run_id, resume_config, resume_point, save_config
from flows.schedule import schedule
from flows.unfinished import mark_unfinished
from flows.warmstart import for_run as warm_start_for
from infra.cells.cluster import default_worker_env, quiet_completed_tasks, start_cells
from infra.cells.reach import check_store
from infra.engine.pretrained import prepare
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.gateway import Gateway
from storage.checkpoints import publish_checkpoint
from storage.lease import Lease
from storage.paths import spool_dir
from storage.sql import query
from storage.store import Store

log = logging.getLogger(__name__)

Preset = Literal.__getitem__(tuple(sorted(PRESETS)))  # a choice in the Run form

# what this process and every cell both use (the gateway's tokenizer and each engine's):
# `gyre run` imports it before it forks the cells' zygote (infra/cells/zygote.py), once for all
SHARED_PRELOAD = ("transformers.models.auto.tokenization_auto",)

# what a cell imports in the background as soon as it starts, while this process sets up
# the gateway and the scheduling flow: the engine (torch, transformers) and the tasks'
# modules; under `gyre run`, the zygote the cells are forked from imports them instead
CELL_PRELOAD = (
    "transformers.modeling_utils",
    "infra.engine.engine",
    "infra.engine.server",
    "infra.cells.pacing",
    "tasks.rollout",
    "tasks.evaluate",
    "tasks.process",
    "tasks.train_step",
)


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
    # DuckDB sums integers to DECIMAL: plain numbers (counts stay integers) for the summary
    return {k: plain(v) for k, v in out.items()}


def _initial_name() -> str:
    """The flow run's name before the run id is known (renamed once it is)."""
    p = flow_run.parameters
    what = p.get("run_id") or "new run"
    how = "resume" if p.get("resume") else (p.get("preset") or "config")
    return f"{what} | {how}"


def _rename(name: str) -> None:
    """Name the flow run after what it is: run id, preset, steps (best effort)."""
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, name=name)
    except Exception as exc:
        log.warning("could not rename the flow run: %s", exc)


def resolve(
    preset: str | None,
    overrides: list[str],
    store: str | None,
    config_file: str | None,
    run_id: str | None,
    resume: bool,
) -> RunConfig:
    """The run's settings: a resumed run's stored ones (then ``overrides``), else the
    preset, the file, the store and the overrides (flows/config.py)."""
    over = list(overrides) + ([f"run_id={run_id}"] if run_id else [])
    if resume and run_id:
        base = load_config(config_file=config_file, preset=preset, overrides=over, store=store)
        st = Store(base.store)
        if st.exists("runs", run_id, "config.json"):
            return resume_config(run_id, base.store, overrides)
    return load_config(config_file=config_file, preset=preset, overrides=over, store=store)


def rl_run(
    preset: Preset | None = "tiny",
    overrides: list[str] | None = None,
    store: str | None = None,
    config_file: str | None = None,
    run_id: str | None = None,
    resume: bool = False,
    more_steps: int | None = None,
) -> dict[str, Any]:
    """One RL run of a task suite: validated settings, cells, engines, gateway, loop.

    Args:
        preset: starting settings: {presets}.
        overrides: settings as "key=value" strings, applied after the preset, e.g.
            ["train.steps=8", "scheduler.mode=async", "rollout.suite=tools"]
            (every key: `gyre run --help` and flows/config.py).
        store: where the run's data and checkpoints go: a directory or s3://bucket/prefix
            (default ./gyre-data).
        config_file: a YAML file of settings, applied after the preset.
        run_id: the run's name (its data, checkpoints and log are keyed by it); empty for a
            new one. Letters, digits, ".", "_" and "-".
        resume: continue run `run_id` from its last committed step with its stored settings
            (then `overrides`), or start it if the store has no such run.
        more_steps: with `resume`, train this many steps more than the run has (a nightly
            deployment continues one run by a few steps each night); empty trains up to
            `train.steps` in total.
    """
    # a deployment run checks the world too, before anything starts, every problem at once
    cfg = checked(lambda: resolve(preset, overrides or [], store, config_file, run_id, resume))
    run_id = cfg.run_id or new_run_id()
    st = Store(cfg.store)
    # one writer per run: a second run (or `gyre serve`) of this run id is refused
    with Lease(st, run_id, f"gyre run ({'resume' if resume else 'new'})"):
        return _run(cfg, st, run_id, preset, resume, more_steps)


# the Run form's help of `preset` says what each preset is, from the presets themselves
rl_run.__doc__ = (rl_run.__doc__ or "").replace("{presets}", preset_help())
rl_run = flow(name="rl_run", flow_run_name=_initial_name, validate_parameters=True)(rl_run)


def model_dir_of(cfg: RunConfig, say: Callable[[str], None] = print) -> str:
    """The checkpoint a run starts from: ``model.path``, the pretrained ``model.name``
    (prepared on first use) or else the tiny model; with ``warmstart.enabled``, the warm
    start of that model (built on first use)."""
    base = cfg.model.path
    if base is None and cfg.model.name is not None:
        base = prepare(cfg.model.name, say=say)
    return (
        warm_start_for(cfg, say=say, base=base)
        or base
        or make_tiny_model(
            seed=cfg.model.seed, max_position_embeddings=cfg.model.max_position_embeddings
        )
    )


def _run(
    cfg: RunConfig, st: Store, run_id: str, preset: str | None, resume: bool, more_steps: int | None
) -> dict[str, Any]:
    """The run's body, while this process holds the run's lease."""
    logger = get_run_logger()
    quiet_completed_tasks()  # the tasks that run in this process (sub-flows' glue)
    t0 = time.monotonic()
    model_dir = model_dir_of(cfg, say=logger.info)
    spool = spool_dir(st.url, run_id)
    point = resume_point(st, run_id, _journal_groups(spool))
    if point.fresh:
        publish_checkpoint(st, run_id, model_dir, 0)
    version = 0 if point.fresh else point.version
    if more_steps is not None:
        cfg = cfg.model_copy(
            update={"train": cfg.train.model_copy(update={"steps": point.next_step + more_steps})}
        )
    cfg = cfg.model_copy(update={"run_id": run_id})
    steps = cfg.train.steps - point.next_step
    _rename(
        f"{run_id} | {preset if not resume else 'resume'} | "
        f"steps {point.next_step}-{cfg.train.steps - 1} of {cfg.train.steps}"
    )
    if steps <= 0:
        logger.warning(
            "run %s already has %d steps (train.steps=%d): nothing to train; pass "
            "train.steps=N (or more_steps) to train further",
            run_id,
            point.next_step,
            cfg.train.steps,
        )
        return {"run_id": run_id, "store": st.url, "steps": 0, "weight_version": version}
    save_config(st, cfg)
    create_markdown_artifact(
        key=artifact_key("gyre-config", run_id),
        markdown=config_markdown(cfg.model_dump(mode="json")),
        description=f"gyre run {run_id}: settings",
    )
    logger.info(
        "run %s: store %s, model %s, %s at step %d from v%d, %d step(s) to go",
        run_id,
        st.url,
        model_dir,
        "starting" if point.fresh else "resuming",
        point.next_step,
        version,
        steps,
    )

    with get_client(sync_client=True) as client:
        api_url = client.api_url
    env = {
        **default_worker_env(),
        "PREFECT_API_URL": str(api_url).rstrip("/"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    sc = cfg.scheduler
    n_cells = cfg.cluster.rollout_cells + cfg.cluster.train_cells
    # the run's token: the gateway's admin calls and, beyond loopback, every call to the
    # cells' engines (generation, weight loads, KV export/import) need it
    token = secrets.token_urlsafe(24)
    host = cfg.cluster.advertise_host
    # the gateway is made while the cells start (its tokenizer: a second of transformers'
    # imports); its write-ahead log lives where a later process can replay it
    with (
        _made_meanwhile(
            Gateway,
            st,
            run_id=run_id,
            tokenizer_dir=model_dir,
            admin_token=token,
            engine_token=token,
            host=host,
            port=cfg.gateway.port,
            max_body_bytes=cfg.gateway.max_body_mb << 20,
            spool_dir=str(spool),
        ) as made_gateway,
        start_cells(
            n_cells,
            threads_per_cell=cfg.cluster.threads_per_cell,
            memory_limit=cfg.cluster.memory_limit,
            scheduler_address=cfg.cluster.scheduler_address,
            env=env,
            rollout_slots=sc.groups_per_cell,
            harness_slots=sc.groups_per_cell,
            host=host,
            token=token,
            preload=CELL_PRELOAD,
        ) as cells,
    ):
        record_children()  # if this process is killed, the next `gyre run` stops its cells
        check_store(cells, st, run_id)  # every cell's host reaches the store (or is named)
        if cells.dashboard_link:
            logger.info("Dask dashboard: %s", cells.dashboard_link)
        gateway = made_gateway()
        gateway.start()
        logger.info("cells and gateway up in %.1fs", time.monotonic() - t0)
        try:
            live.register(run_id, cells, gateway, model_dir)
            runner = DaskTaskRunner(address=cells.scheduler_address)
            loop = schedule.with_options(task_runner=runner)(
                run_id,
                cfg,
                st,
                version,
                first_step=point.next_step,
                first_group=point.first_group,
                steps=steps,
            )
        finally:
            live.drop(run_id)
            gateway.stop()
            _mark_unfinished(st, run_id, spool, logger)  # the sessions it leaves in flight
        # training is done: the cells are torn down while the summary is written (it needs
        # the store, not the cells); the end of the block waits for the teardown, which
        # may be slow under load but never fails the run (infra/cells/cluster.py)
        cells.stop_soon()
        summary = _summary(loop, st, run_id, sc.mode, time.monotonic() - t0)
        summary = write_learning(st, run_id, summary)  # held-out figures, curve, summary.json
        create_markdown_artifact(
            key=artifact_key("gyre-summary", run_id),
            markdown=summary_markdown(summary, st.url, run_id),
            description=f"gyre run {run_id}",
        )
    forget()  # nothing of this run is left to reap
    logger.info("summary: %s", {k: rounded(v) for k, v in summary.items()})
    return summary


@contextmanager
def _made_meanwhile(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Iterator[Callable]:
    """``fn(*args, **kwargs)`` runs in a thread of its own while the block runs; the block
    takes the result by calling what this yields. If the block fails before it takes it,
    the result is closed once it is made (a gateway: its write-ahead log, its files)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=f"gyre-{fn.__name__}")
    made = pool.submit(fn, *args, **kwargs)
    pool.shutdown(wait=False)
    taken: list = []

    def take() -> Any:
        taken.append(made.result())
        return taken[0]

    try:
        yield take
    except BaseException:
        if not taken:
            made.add_done_callback(lambda f: f.exception() is None and f.result().close())
        raise


def _mark_unfinished(st: Store, run_id: str, spool, logger) -> None:
    """Sessions of the run's journal without a ``rollouts`` row (in flight at the end, or
    left by a killed attempt of this run) get one of status ``unfinished``
    (flows/unfinished.py); the run's outcome stands whatever happens here."""
    try:
        if n := mark_unfinished(st, run_id, spool / "sessions.jsonl"):
            logger.info("%d session(s) in flight at the end: rollouts status 'unfinished'", n)
    except Exception as exc:  # the run that continues this one marks them
        logger.warning("could not mark the sessions left in flight: %s", exc)


def _summary(loop: dict, st: Store, run_id: str, mode: str, seconds: float) -> dict[str, Any]:
    stats = loop["stats"]
    lat = sorted(stats.switch_latency_s)
    return {
        "run_id": run_id,
        "store": st.url,
        "mode": mode,
        "steps": stats.steps,
        "weight_version": loop["weight_version"],
        **_totals(st, run_id),
        "switches": stats.switches,
        "sessions_rerouted": stats.sessions_rerouted,
        "kv_moved": stats.kv_moved,
        "switch_latency_s": round(lat[len(lat) // 2], 3) if lat else None,
        "cells_lost": stats.cells_lost,
        "step_retries": stats.step_retries,
        "report": loop["report"]["dir"],
        "seconds": round(seconds, 1),
    }


def _journal_groups(spool) -> list[str]:
    """Group ids of the sessions in a run's gateway journal (none for a new run)."""
    from infra.gateway.sessions import SessionTable

    path = spool / "sessions.jsonl"
    if not path.exists():
        return []
    return [s.group_id for s in SessionTable(str(path)).all()]
