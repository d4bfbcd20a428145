"""The ``gyre`` command line.

    gyre run [--config FILE] [--preset tiny|demo] [--store URL] [key=value ...]
    gyre sql [--store URL] [--format table|csv|json] ["SELECT ..."]
    gyre serve [--model DIR] [--store URL] [--port N]
    gyre session new [--url URL] [--admin-token TOKEN]

Heavy imports (prefect, torch) happen inside the sub-commands, after the
environment below is set, so ``gyre sql`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
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


def _serve_file() -> Path:
    from storage.paths import cache_dir

    return cache_dir() / "serve.json"


def cmd_run(args: argparse.Namespace) -> int:
    from flows.config import ConfigError, load_config

    try:  # fail before anything starts
        cfg = load_config(
            config_file=args.config, preset=args.preset, overrides=args.overrides, store=args.store
        )
    except ConfigError as exc:
        print(f"gyre run: {exc}", file=sys.stderr)
        return 2
    from flows.rl_run import rl_run

    print(
        f"gyre run: preset={args.preset} store={cfg.store} steps={cfg.train.steps} "
        f"(starting Prefect, cells, engine, gateway...)",
        file=sys.stderr,
    )
    summary = rl_run(
        preset=args.preset,
        overrides=list(args.overrides),
        store=args.store,
        config_file=args.config,
    )
    width = max(len(k) for k in summary)
    print("\nrun summary")
    for k, v in summary.items():
        print(
            f"  {k.ljust(width)}  {v:.4g}" if isinstance(v, float) else f"  {k.ljust(width)}  {v}"
        )
    print(f'\nquery it:  gyre sql --store {summary["store"]} "SELECT * FROM steps"')
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    from storage.sql import VIEW_COUNTS, SqlError, format_table, query
    from storage.store import Store, StoreError

    try:
        store = Store(args.store, create=False, retry_s=SQL_STORE_RETRY_S)
    except StoreError as exc:
        print(f"gyre sql: {exc}", file=sys.stderr)
        return 2
    try:
        print(format_table(query(store, args.query or VIEW_COUNTS), args.format))
    except (SqlError, StoreError) as exc:
        print(f"gyre sql: {exc}", file=sys.stderr)
        return 2
    finally:
        for seg in store.quarantined:
            print(
                f"gyre sql: corrupt segment {seg} quarantined (see _quarantine/)", file=sys.stderr
            )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import secrets

    from infra.engine.engine import Engine
    from infra.engine.server import EngineServer
    from infra.engine.tiny_model import make_tiny_model
    from infra.gateway.gateway import Gateway
    from storage.store import Store

    model_dir = args.model or make_tiny_model()
    store = Store(args.store)
    engine = Engine(model_dir, cell_id="serve")
    server = EngineServer(engine)
    engine_url = server.start()
    token = secrets.token_urlsafe(24)
    run_id = args.run_id or time.strftime("serve-%Y%m%d-%H%M%S")
    gw = Gateway(store, run_id=run_id, tokenizer_dir=model_dir, admin_token=token, port=args.port)
    url = gw.start()
    gw.add_engine("serve", engine_url)
    f = _serve_file()
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps({"url": url, "admin_token": token, "store": store.url}))
    os.chmod(f, 0o600)
    print(f"gyre serve: model {model_dir}")
    print(f"  base URL     {url}/v1   (OpenAI-compatible; native /generate at {url}/generate)")
    print(f"  store        {store.url}  (run_id {run_id})")
    print("  session key  gyre session new      (prints a session id and its API key)")
    print(f'  inspect      gyre sql --store {store.url} "SELECT * FROM tito"')
    print("Ctrl-C to stop.", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        gw.stop()
        server.stop()
        f.unlink(missing_ok=True)
    return 0


def cmd_session(args: argparse.Namespace) -> int:
    import httpx

    url, token = args.url, args.admin_token
    if url is None or token is None:
        try:
            info = json.loads(_serve_file().read_text())
        except OSError:
            print(
                "gyre session new: no running `gyre serve` found; pass --url and --admin-token",
                file=sys.stderr,
            )
            return 2
        url, token = url or info["url"], token or info["admin_token"]
    r = httpx.post(
        f"{url}/gyre/sessions", json={}, timeout=30, headers={"Authorization": f"Bearer {token}"}
    )
    if r.status_code != 200:
        print(f"gyre session new: {r.status_code} {r.text}", file=sys.stderr)
        return 2
    body = r.json()
    print(
        json.dumps(
            {"session_id": body["session_id"], "api_key": body["api_key"], "base_url": f"{url}/v1"},
            indent=2,
        )
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    from flows.config import PRESETS  # pure and light: pydantic + the section models

    p = argparse.ArgumentParser(prog="gyre", description="elastic RL for long-horizon LLM agents")
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="run the RL flow (Prefect flow rl_run on a Dask cluster)")
    r.add_argument("--config", help="YAML run config")
    r.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    r.add_argument("--store", help=f"fsspec URL of the store (default {DEFAULT_STORE})")
    r.add_argument("overrides", nargs="*", metavar="key=value")
    r.set_defaults(fn=cmd_run)

    q = sub.add_parser("sql", help="read-only DuckDB SQL over the store's views")
    q.add_argument("--store", default=DEFAULT_STORE)
    q.add_argument("--format", choices=["table", "csv", "json"], default="table")
    q.add_argument("query", nargs="?", help="SQL; without it, row counts of every view")
    q.set_defaults(fn=cmd_sql)

    s = sub.add_parser("serve", help="engine + gateway on loopback for your own harness")
    s.add_argument("--model", help="local HF checkpoint dir (default: the tiny model)")
    s.add_argument("--store", default=DEFAULT_STORE)
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--run-id")
    s.set_defaults(fn=cmd_serve)

    n = sub.add_parser("session", help="sessions of a running `gyre serve`")
    n.add_argument("action", choices=["new"])
    n.add_argument("--url")
    n.add_argument("--admin-token")
    n.set_defaults(fn=cmd_session)
    return p


def main(argv: list[str] | None = None) -> int:
    for k, v in _ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
