"""Checks that need the world, run before anything starts (no Prefect, no cells).

``load_config`` checks a run config on its own (types, ranges, names); this checks
it against the machine and the network: the store is reachable and writable (its
bucket exists), the gateway's port is free, an external Dask scheduler answers, and
``model.path`` is a checkpoint. Every problem is reported at once, as a
`flows.config.ConfigError`, each naming the setting, the value, and the fix.
"""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path

from flows.config import ConfigError, RunConfig

PROBE_TIMEOUT_S = 10.0

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


def check_scheduler(address: str) -> str | None:
    hostport = address.split("://", 1)[1]
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S):
            return None
    except OSError as exc:
        return f"no Dask scheduler answers there ({exc.strerror or exc}); start `dask scheduler`"


def preflight(cfg: RunConfig) -> None:
    """Raise `ConfigError` listing every problem of ``cfg`` against the world."""
    problems = []
    if (why := check_store(cfg.store)) is not None:
        problems.append(f"store={cfg.store!r}: {why}")
    if (why := check_port(cfg.gateway.port)) is not None:
        problems.append(f"gateway.port={cfg.gateway.port}: {why}; pick another or 0 (any)")
    if (
        cfg.cluster.scheduler_address
        and (why := check_scheduler(cfg.cluster.scheduler_address)) is not None
    ):
        problems.append(f"cluster.scheduler_address={cfg.cluster.scheduler_address!r}: {why}")
    if cfg.model.path is not None and (why := check_model_dir(cfg.model.path)) is not None:
        problems.append(
            f"model.path={cfg.model.path!r}: {why}; give a Hugging Face checkpoint directory "
            "or leave it unset for the tiny model"
        )
    if problems:
        raise ConfigError(problems)
