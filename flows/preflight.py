"""Checks that need the world, run before anything starts (no Prefect, no cells).

``load_config`` checks a run config on its own (types, ranges, names); this checks
it against the machine and the network: the store is reachable and writable (its
bucket exists), the gateway's port is free, an external Dask scheduler answers with a
worker per cell, ``model.path`` is a checkpoint and ``model.name`` can be prepared. Every problem is reported at once,
as a `flows.config.ConfigError`, each naming the setting, the value, and the fix;
`checked` adds them to the errors of a config that has some. `check_prefect_api` checks the
environment's ``PREFECT_API_URL`` (``gyre run`` asks it first: with one set, the run uses
that server instead of starting its own).
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from flows.config import WORLD_KEYS, ConfigError, RunConfig
from infra.engine.pretrained import problem as pretrained_problem

PROBE_TIMEOUT_S = 10.0
WORKERS_WAIT_S = 15.0  # an external scheduler's workers may still be joining

# what a Hugging Face checkpoint directory must hold for the engine and the trainer
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_TOKENIZER = ("tokenizer.json", "tokenizer_config.json")


def check_model_dir(path: str) -> str | None:
    """Why ``path`` is not a usable checkpoint, or None."""
    d = Path(path).expanduser()
    if not d.is_dir():
        return "no such directory"
    missing = []
    try:
        cfg = json.loads((d / "config.json").read_text())
        if "model_type" not in cfg:
            missing.append("a config.json with model_type")
    except (OSError, ValueError):
        missing.append("config.json")
    if not any((d / w).is_file() for w in _WEIGHTS):
        missing.append(f"weights ({' or '.join(_WEIGHTS)})")
    if not any((d / w).is_file() for w in _TOKENIZER):
        missing.append("a tokenizer (tokenizer.json)")
    return f"not a checkpoint: it lacks {', '.join(missing)}" if missing else None


def check_store(url: str) -> str | None:
    """Why the store cannot be written, or None (a local directory is created)."""
    from storage.store import Store, StoreError, url_problem

    if (why := url_problem(url, shared=True)) is not None:
        return why
    try:
        store = Store(url, retry_s=PROBE_TIMEOUT_S)
        if store.protocol not in ("file", "memory"):
            # the bucket must exist: a run never creates buckets
            bucket = store.root.split("/", 1)[0]
            Store(f"{store.protocol}://{bucket}", create=False, retry_s=PROBE_TIMEOUT_S)
        probe = f"_preflight/{uuid.uuid4().hex}"
        store.write_bytes(probe, b"ok")
        store.fs.rm(store.path(probe))
    except StoreError as exc:
        return str(exc)
    except PermissionError as exc:
        return f"not writable ({exc})"
    except OSError as exc:
        return f"cannot write there ({type(exc).__name__}: {exc})"
    return None


def check_port(port: int, host: str = "127.0.0.1") -> str | None:
    if port == 0:
        return None
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return f"port {port} is in use ({exc.strerror})"
    return None


def check_host(host: str) -> str | None:
    """Why this host cannot listen on ``host`` (the run's endpoints bind it), or None."""
    try:
        with socket.socket() as s:
            s.bind((host, 0))
    except OSError as exc:
        return (
            f"this host cannot listen there ({exc.strerror or exc}): give one of its own "
            "addresses (`ip -br addr`), as the other hosts reach it"
        )
    return None


def check_new_local_store(url: str) -> str | None:
    """Why a local store directory that does not exist yet could not be created, or None
    (nothing is created: the check of a config that has errors leaves no trace)."""
    path = Path(url.removeprefix("file://")).expanduser().absolute()
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot create it: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create it: {parent} is not writable"
    return None


def check_scheduler(address: str, cells: int | None = None) -> str | None:
    """Why no Dask scheduler at ``address`` can hold ``cells`` cells, or None: it must
    answer and, within `WORKERS_WAIT_S`, have a worker per cell."""
    from infra.cells.cluster import TooFewWorkers, reach_scheduler, wait_for_cells

    try:
        reach_scheduler(address, timeout=PROBE_TIMEOUT_S)
    except OSError as exc:
        return f"no Dask scheduler answers there ({exc.strerror or exc}); start `dask scheduler`"
    if cells is None:
        return None
    from distributed import Client

    try:
        with Client(address, timeout=f"{PROBE_TIMEOUT_S}s", set_as_default=False) as client:
            wait_for_cells(client, cells, timeout=WORKERS_WAIT_S)
    except TooFewWorkers as exc:
        return str(exc)
    except OSError as exc:
        return f"it does not answer as a Dask scheduler ({exc}); start `dask scheduler`"
    return None


def preflight(cfg: RunConfig, *, only: frozenset[str] | None = None, create: bool = True) -> None:
    """Raise `ConfigError` listing every problem of ``cfg`` against the world.

    ``only``: check just these settings (`flows.config.WORLD_KEYS`); ``create=False``: make
    no store directory (the checks of a config that has errors, `checked`)."""

    def wanted(key: str) -> bool:
        return only is None or key in only

    problems = []
    if wanted("store"):
        is_local = "://" not in cfg.store or cfg.store.startswith("file://")
        if not create and is_local and not Path(cfg.store.removeprefix("file://")).exists():
            why = check_new_local_store(cfg.store)
        else:
            why = check_store(cfg.store)
        if why is not None:
            problems.append(f"store={cfg.store!r}: {why}")
    c = cfg.cluster
    host = c.advertise_host if wanted("cluster.advertise_host") else "127.0.0.1"
    if wanted("cluster.advertise_host") and (why := check_host(host)) is not None:
        problems.append(f"cluster.advertise_host={host!r}: {why}")
        host = "127.0.0.1"
    if wanted("gateway.port") and (why := check_port(cfg.gateway.port, host)) is not None:
        problems.append(f"gateway.port={cfg.gateway.port}: {why}; pick another or 0 (any)")
    if wanted("cluster.scheduler_address") and c.scheduler_address:
        n = c.rollout_cells + c.train_cells
        cells = n if wanted("cluster.rollout_cells") and wanted("cluster.train_cells") else None
        if (why := check_scheduler(c.scheduler_address, cells)) is not None:
            problems.append(f"cluster.scheduler_address={c.scheduler_address!r}: {why}")
    if (
        wanted("model.path")
        and cfg.model.path is not None
        and (why := check_model_dir(cfg.model.path)) is not None
    ):
        problems.append(
            f"model.path={cfg.model.path!r}: {why}; give a Hugging Face checkpoint directory "
            "or leave it unset for the tiny model"
        )
    if (
        wanted("model.name")
        and cfg.model.name is not None
        and (why := pretrained_problem(cfg.model.name)) is not None
    ):
        problems.append(f"model.name={cfg.model.name!r}: {why}")
    if problems:
        raise ConfigError(problems)


def check_prefect_api(url: str | None, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the Prefect API at ``url`` (the environment's ``PREFECT_API_URL``) cannot serve
    a run, or None: unset (a run starts a temporary server of its own), or it answers (any
    HTTP reply: Prefect Cloud's workspaces answer without the self-hosted ``/health``)."""
    if not url:
        return None
    import httpx

    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=timeout)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        why = str(exc) or type(exc).__name__
        return (
            f"PREFECT_API_URL={url!r}: no Prefect API answers there ({why}); unset "
            "PREFECT_API_URL for a temporary server of the run's own, or start one with "
            "`prefect server start` and point PREFECT_API_URL at it "
            "(http://127.0.0.1:4200/api)"
        )
    return None


def checked(load: Callable[[], RunConfig], also: Sequence[str] = ()) -> RunConfig:
    """``load()`` (a `flows.config.load_config`) then `preflight`, every problem at once: a
    config with errors still has its valid world settings checked, and both are reported
    together in one `ConfigError`. ``also``: problems found before (the environment's,
    `check_prefect_api`), reported first; with any, the checks create nothing either."""
    try:
        cfg = load()
    except ConfigError as exc:
        if exc.partial is None:
            if also:
                raise ConfigError([*also, *exc.problems]) from None
            raise
        only = frozenset(WORLD_KEYS) - exc.unchecked
        try:
            preflight(exc.partial, only=only, create=False)
        except ConfigError as world:
            raise ConfigError([*also, *exc.problems, *world.problems]) from None
        if also:
            raise ConfigError([*also, *exc.problems]) from None
        raise
    if also:
        try:
            preflight(cfg, create=False)
        except ConfigError as world:
            raise ConfigError([*also, *world.problems]) from None
        raise ConfigError(list(also))
    preflight(cfg)
    return cfg
