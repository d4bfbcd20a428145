"""The ``gyre`` command line.

    gyre run [--config FILE] [--preset tiny|demo|tools|repo|smol] [--store URL] [key=value ...]
    gyre run --resume RUN_ID [--store URL] [key=value ...]
    gyre run --from-served RUN_ID [--store URL] [train.key=value ...]
    gyre config [--list] [--preset NAME] [--config FILE] [key=value ...]
    gyre sql [--store URL] [--format table|csv|json] ["SELECT ..."]
    gyre serve [--model DIR] [--store URL] [--port N]
    gyre session new [--url URL] [--admin-token TOKEN] [--port N]
    gyre export RUN_ID [--store URL] --out FILE [--format parquet]
    gyre warmstart --suite tools [--difficulty N] [--steps N] [--out DIR] ...
    gyre model prepare smollm2 [--out DIR] [--force]

Heavy imports (prefect, torch) happen inside the sub-commands, after the
environment below is set, so ``gyre sql`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from importlib import import_module
from pathlib import Path

DEFAULT_STORE = "./gyre-data"
SQL_STORE_RETRY_S = 15.0  # an interactive query waits less for an unreachable store than a run

# Set before prefect/distributed are imported (also inherited by worker processes).
_ENV_DEFAULTS = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DASK_LOGGING__DISTRIBUTED": "warning",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' load/save bars; gyre shows its own
    "TOKENIZERS_PARALLELISM": "false",
}


def cmd_run(args: argparse.Namespace) -> int:
    from flows.config import ConfigError, load_config
    from flows.preflight import check_prefect_api, checked
    from flows.procs import bounded_stop, forget, prefect_api, reap_orphans
    from flows.resume import new_run_id, resume_config
    from storage.lease import LeaseHeld, check_free
    from storage.store import Store

    if args.from_served:
        return _run_from_served(args)
    if args.resume and (args.preset or args.config):  # the stored settings are the base
        flag = "--preset" if args.preset else "--config"
        print(
            f"gyre run: {flag} with --resume: a resumed run continues with its stored "
            f"settings; drop {flag} and change settings with key=value overrides",
            file=sys.stderr,
        )
        return 2
    args.preset = args.preset or (None if args.resume else "tiny")
    reap_orphans()  # what a killed run left behind (its Prefect server, stray cells)
    # a PREFECT_API_URL that nothing answers at: said (with the config's problems) before
    # anything is created, not as a traceback from the flow's first call
    env = [why] if (why := check_prefect_api(os.environ.get("PREFECT_API_URL"))) else []
    try:  # fail before anything starts, every problem at once
        if args.resume:
            cfg = checked(
                lambda: resume_config(args.resume, args.store or DEFAULT_STORE, args.overrides),
                also=env,
            )
        else:
            cfg = checked(
                lambda: load_config(
                    config_file=args.config,
                    preset=args.preset,
                    overrides=args.overrides,
                    store=args.store,
                ),
                also=env,
            )
    except ConfigError as exc:  # the environment's problem alone: one line
        print(f"gyre run: {env[0] if exc.problems == env else exc}", file=sys.stderr)
        return 2
    run_id = cfg.run_id or new_run_id()  # named here, so that a stopped run can be resumed
    try:  # another process writing this run: say so before starting anything
        check_free(Store(cfg.store), run_id)
    except LeaseHeld as exc:
        print(f"gyre run: {exc}", file=sys.stderr)
        return 2
    if (done := _steps_done(cfg.store, run_id)) >= cfg.train.steps:  # before Prefect, cells
        print(
            f"gyre run: run {run_id} already has {done} steps (train.steps={cfg.train.steps}): "
            f"nothing to train; continue it with `gyre run --resume {run_id} --store "
            f"{cfg.store} train.steps=N` with N > {done}",
            file=sys.stderr,
        )
        return 2
    what = f"resume={args.resume}" if args.resume else f"preset={args.preset}"
    print(
        f"gyre run: {run_id} {what} store={cfg.store} steps={cfg.train.steps} "
        f"(starting Prefect, cells, engine, gateway...)",
        file=sys.stderr,
    )
    try:
        # the flow's imports (prefect, torch, ...) overlap the Prefect server's start
        with bounded_stop(), prefect_api(while_starting=_import_flow_and_fork_zygote):
            from flows.rl_run import rl_run

            summary = rl_run(
                preset=None if args.resume else args.preset,
                overrides=list(args.overrides),
                store=cfg.store,
                config_file=None if args.resume else args.config,
                run_id=run_id,
                resume=bool(args.resume),
            )
    except LeaseHeld as exc:  # taken between the check above and the run's start
        print(f"gyre run: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(f"gyre run: stopped ({exc or 'SIGINT'}); continue it with `gyre run --resume "
              f"{run_id} --store {cfg.store}`", file=sys.stderr)  # fmt: skip
        forget()
        return 130
    except Exception as exc:
        if (line := _run_failure(exc, f"gyre run --resume {run_id} --store {cfg.store}")) is None:
            raise
        print(f"gyre run: {line}", file=sys.stderr)  # one line, not a traceback
        forget()
        return 1
    forget()
    width = max(len(k) for k in summary)
    print("\nrun summary")
    for k, v in summary.items():
        print(
            f"  {k.ljust(width)}  {v:.4g}" if isinstance(v, float) else f"  {k.ljust(width)}  {v}"
        )
    rid = summary["run_id"]
    print(
        f"\nquery it:  gyre sql --store {summary['store']} "
        f"\"SELECT * FROM steps WHERE run_id = '{rid}' ORDER BY step\""
    )
    print(f"continue it:  gyre run --resume {rid} --store {summary['store']} train.steps=N")
    return 0


def _steps_done(store: str, run_id: str) -> int:
    """Steps ``run_id`` has committed in ``store`` (0: a new run or a store not made yet);
    read only, so that asking creates nothing."""
    from storage.commits import last_committed
    from storage.store import Store, StoreError

    try:
        last = last_committed(Store(store, create=False), run_id)
    except (StoreError, FileNotFoundError):
        return 0
    return last[0] if last else 0


def _import_flow_and_fork_zygote() -> None:
    """While the Prefect server starts: import the flow (prefect, torch, transformers) and
    what both this process and the cells use, then fork the process the cells will be
    forked from (infra/cells/zygote.py), which imports what only the cells use."""
    from infra.cells.zygote import start_zygote

    rl_run = import_module("flows.rl_run")
    for name in rl_run.SHARED_PRELOAD:
        import_module(name)
    start_zygote(preload=rl_run.CELL_PRELOAD)


def _run_from_served(args: argparse.Namespace) -> int:
    """``gyre run --from-served RUN_ID``: one optimizer step on the scored sessions a
    ``gyre serve`` recorded (flows/served.py); no Prefect, no cells."""
    from flows.config import ConfigError, load_config
    from flows.served import ServedError, train_served
    from storage.lease import LeaseHeld
    from storage.store import Store, StoreError

    try:
        cfg = load_config(config_file=args.config, overrides=args.overrides, store=args.store)
        store = Store(cfg.store, create=False)
        out = train_served(store, args.from_served, cfg, say=lambda m: print(f"gyre run: {m}"))
    except (ConfigError, ServedError, LeaseHeld, StoreError) as exc:
        print(f"gyre run: {exc}", file=sys.stderr)
        return 2
    width = max(len(k) for k in out)
    for k, v in out.items():
        print(
            f"  {k.ljust(width)}  {v:.4g}" if isinstance(v, float) else f"  {k.ljust(width)}  {v}"
        )
    print(f"serve it:  gyre serve --store {out['store']} --run-id {out['run_id']} "
          f"--model {out['checkpoint']}")  # fmt: skip
    return 0


def _run_failure(exc: BaseException, resume: str) -> str | None:
    """The line that explains a run's end by ``exc``, where its cause is one a user can act
    on (a lost Dask scheduler, a broken agent, a store outage); None for anything else."""
    from infra.cells.cluster import SchedulerLost
    from infra.cells.reach import StoreUnreachable
    from storage.store import StoreError
    from tasks.rollout import RolloutsFailed

    if (lost := _cause(exc, lambda e: isinstance(e, SchedulerLost))) is not None:
        return f"{lost}; then continue the run with `{resume}`"
    if (far := _cause(exc, lambda e: isinstance(e, StoreUnreachable))) is not None:
        return f"{far}\nthen continue the run with `{resume}`"  # names each cell and host
    if (failed := _cause(exc, lambda e: isinstance(e, RolloutsFailed))) is not None:
        return str(failed)  # the agent is broken (every reason is in the rollouts view)
    if (out := _cause(exc, lambda e: isinstance(e, StoreError) and bool(e.outage))) is not None:
        return f"{out}; continue it with `{resume}` once the store is back"
    return None


def _cause(exc: BaseException, match: Callable[[BaseException], bool]) -> BaseException | None:
    """The exception behind ``exc`` (itself, or what caused it) that ``match`` accepts."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if match(e):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def cmd_sql(args: argparse.Namespace) -> int:
    from storage.sql import VIEW_COUNTS, SqlError, format_table, query
    from storage.store import Store, StoreError

    try:
        store = Store(args.store, create=False, retry_s=SQL_STORE_RETRY_S)
    except StoreError as exc:
        print(f"gyre sql: --store {args.store!r}: {exc}", file=sys.stderr)
        return 2
    try:
        limits: dict = {}
        if args.memory_limit is not None:
            limits["memory_limit"] = args.memory_limit
        if args.timeout is not None:
            limits["timeout_s"] = args.timeout if args.timeout > 0 else None
        table = query(store, args.query or VIEW_COUNTS, **limits)
        print(format_table(table, args.format))
    except (SqlError, StoreError) as exc:
        print(f"gyre sql: {exc}", file=sys.stderr)
        return 2
    finally:
        for seg in store.quarantined:
            print(
                f"gyre sql: corrupt segment {seg} quarantined (see _quarantine/)", file=sys.stderr
            )
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """Every setting with its value (the defaults, a preset's, a file's, overrides) and
    its meaning; without --list, only the settings that differ from the defaults."""
    from flows.config import ConfigError, load_config, settings_text

    try:
        cfg = load_config(config_file=args.config, preset=args.preset, overrides=args.overrides)
    except ConfigError as exc:
        print(f"gyre config: {exc}", file=sys.stderr)
        return 2
    text = settings_text(cfg, changed_only=not args.list)
    print(text or "every setting at its default (gyre config --list shows them all)")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from flows.serve import main_serve

    return main_serve(args)


def cmd_session(args: argparse.Namespace) -> int:
    from flows.serve import main_session

    return main_session(args)


def cmd_export(args: argparse.Namespace) -> int:
    from flows.export import main_export

    return main_export(args)


def cmd_warmstart(args: argparse.Namespace) -> int:
    from flows.warmstart import main_warmstart

    return main_warmstart(args)


def cmd_model(args: argparse.Namespace) -> int:
    """Prepare a pretrained model as a local checkpoint; its directory on stdout (so that
    ``gyre serve --model "$(gyre model prepare smollm2)"`` works), progress on stderr."""
    from infra.engine.pretrained import PretrainedError, is_complete, lookup, model_dir, prepare

    def say(line: str) -> None:
        print(f"gyre model: {line}", file=sys.stderr, flush=True)

    out = args.out or model_dir(args.name)
    if is_complete(Path(out).expanduser()) and not args.force:
        say(f"{lookup(args.name).name} is prepared (--force to remake it)")
    else:
        say(f"preparing {lookup(args.name).name} (about half a minute on 2 cores)")
    try:
        path = prepare(args.name, out, force=args.force, say=say)
    except PretrainedError as exc:
        say(str(exc))
        return 2
    say(f"use it:  gyre serve --model {path}")
    say(f"         gyre run model.path={path} ...   (or model.name={lookup(args.name).name})")
    print(path)
    return 0


def _port(text: str) -> int:
    """A TCP port for argparse: 1-65535, else a usage error naming the value."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1-65535)") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (1-65535)")
    return port


def _body_mb(text: str) -> int:
    """A body cap in MiB for argparse, checked as the ``gateway.max_body_mb`` setting is."""
    from pydantic import ValidationError

    from infra.gateway.config import GatewayConfig  # pydantic only: light

    try:
        return GatewayConfig(max_body_mb=int(text)).max_body_mb
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(f"{text} MiB: {exc.errors()[0]['msg']}") from None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of MiB") from None


def build_parser() -> argparse.ArgumentParser:
    from flows.config import PRESETS, preset_help  # pure and light: pydantic + the sections

    p = argparse.ArgumentParser(prog="gyre", description="elastic RL for long-horizon LLM agents")
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="run the RL flow (Prefect flow rl_run on a Dask cluster)")
    r.add_argument("--config", help="YAML run config")
    r.add_argument(
        "--resume",
        metavar="RUN_ID",
        help="continue a run (killed, stopped, or to train further with train.steps=N) from "
        "its last committed step, with its stored settings and then key=value overrides",
    )
    r.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,  # None, not "tiny": so that --preset with --resume can be refused
        help=f"starting settings (default tiny): {preset_help()}",
    )
    r.add_argument(
        "--from-served",
        metavar="RUN_ID",
        help="train one step on the scored sessions a `gyre serve` recorded under RUN_ID and no "
        "earlier pass used (offline RL from the store; train.* settings apply)",
    )
    r.add_argument("--store", help=f"fsspec URL of the store (default {DEFAULT_STORE})")
    r.add_argument("overrides", nargs="*", metavar="key=value")
    r.set_defaults(fn=cmd_run)

    c = sub.add_parser(
        "config", help="list the settings: values, defaults and meanings (key=value lines)"
    )
    c.add_argument("--list", action="store_true", help="every setting, not only those changed")
    c.add_argument("--preset", choices=sorted(PRESETS), help="a preset's values")
    c.add_argument("--config", help="YAML run config, applied after the preset")
    c.add_argument("overrides", nargs="*", metavar="key=value")
    c.set_defaults(fn=cmd_config)

    q = sub.add_parser("sql", help="read-only DuckDB SQL over the store's views")
    q.add_argument("--store", default=DEFAULT_STORE)
    q.add_argument("--format", choices=["table", "csv", "json"], default="table")
    q.add_argument(
        "--memory-limit",
        help="most memory one query may use, e.g. 512MB, 8GB (default 4GB)",
    )
    q.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="stop a query after this long (default 300; 0: no limit)",
    )
    q.add_argument("query", nargs="?", help="SQL; without it, row counts of every view")
    q.set_defaults(fn=cmd_sql)

    s = sub.add_parser("serve", help="engine + gateway on loopback for your own harness")
    s.add_argument("--model", help="local HF checkpoint dir (default: the tiny model)")
    s.add_argument("--store", default=DEFAULT_STORE)
    s.add_argument("--port", type=_port, default=8000, help="the gateway's port (1-65535)")
    s.add_argument(
        "--run-id",
        help="run id of the served calls (default 'serve'; the same store and run id "
        "continue the same run: its log is replayed and its session keys stay valid)",
    )
    s.add_argument(
        "--max-body-mb",
        type=_body_mb,
        default=None,
        help="refuse (413, unread) a request body larger than this many MiB (default 64: a "
        "~2M-token conversation; the gateway.max_body_mb setting of a run)",
    )
    s.set_defaults(fn=cmd_serve)

    e = sub.add_parser("export", help="a run's trajectories as a flat RL dataset (Parquet)")
    e.add_argument("run_id")
    e.add_argument("--store", default=DEFAULT_STORE)
    e.add_argument("--out", required=True, help="output file, e.g. run.parquet")
    e.add_argument("--format", default="parquet", choices=["parquet"])
    e.add_argument(
        "--advantage",
        default="grpo",
        choices=["grpo", "per_subtask", "reward"],
        help="how each branch's advantage is computed (as train.advantage)",
    )
    e.set_defaults(fn=cmd_export)

    w = sub.add_parser(
        "warmstart", help="supervised warm start of a model on a suite's demonstrations"
    )
    w.add_argument("--suite", default="tools", help="tools | repo | package.module:Suite")
    w.add_argument("--difficulty", type=int, default=1)
    w.add_argument("--subtasks", type=int, default=3)
    w.add_argument("--steps", type=int, default=100, help="AdamW steps (default 100)")
    w.add_argument("--lr", type=float, default=3e-3)
    w.add_argument("--batch-size", type=int, default=16)
    w.add_argument("--demos", type=int, default=512, help="distinct demonstrations")
    w.add_argument("--seed", type=int, default=0, help="shuffle/init seed of the pass")
    w.add_argument("--model-seed", type=int, default=0, help="the tiny model's seed")
    w.add_argument("--model", help="a local HF checkpoint to start from (default: the tiny model)")
    w.add_argument("--out", help="checkpoint dir (default: the cache, reused when it exists)")
    w.add_argument("--force", action="store_true", help="rebuild even if it exists")
    w.set_defaults(fn=cmd_warmstart)

    from infra.engine.pretrained import ALIASES, NAMES

    m = sub.add_parser("model", help="pretrained models as local checkpoints (no network)")
    m.add_argument("action", choices=["prepare"])
    m.add_argument("name", choices=sorted([*NAMES, *ALIASES]), help="the model (smollm2)")
    m.add_argument("--out", help="checkpoint dir (default: the model cache, reused when made)")
    m.add_argument("--force", action="store_true", help="remake it even if it exists")
    m.set_defaults(fn=cmd_model)

    n = sub.add_parser("session", help="sessions of a running `gyre serve`")
    n.add_argument("action", choices=["new"])
    n.add_argument("--url", help="gateway URL (default: the one live `gyre serve`)")
    n.add_argument("--admin-token")
    n.add_argument("--port", type=_port, help="pick the `gyre serve` on this port")
    n.set_defaults(fn=cmd_session)
    return p


def main(argv: list[str] | None = None) -> int:
    for k, v in _ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    args = build_parser().parse_args(argv)
    rc = int(args.fn(args) or 0)
    if argv is None and args.fn is cmd_run:
        quick_exit(rc)
    return rc


def quick_exit(rc: int) -> None:
    """End the ``gyre run`` process now that the run is over (its Prefect server stopped,
    cells gone, store written, logs drained, output flushed): the interpreter's own
    finalization of prefect, torch and transformers took 4-90 s (a loaded host) after the
    last line, with nothing left to do."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
