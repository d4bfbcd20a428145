"""Local directories gyre keeps outside the store, all under one cache root.

``GYRE_CACHE`` (default ``~/.cache/gyre``) is the one environment variable that
places them; it is read here and nowhere else:

- ``models/``  the tiny model and tokenizer, and prepared pretrained models
  (``gyre model prepare``), made locally on first use;
- ``spool/<store-key>/<run_id>/``  a run's gateway write-ahead log and session-key
  journal, one per store and run (replayed into the store by the next gateway opened
  on it: ``gyre serve`` or ``gyre run`` with the same store and run id);
- ``serve/<port>.json``  the record of a running ``gyre serve`` (one per port).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

# A run id names directories (spool, checkpoints, runs/, the lease): one path component.
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
RUN_ID_RULE = (
    "1-100 letters, digits, '.', '_' or '-', starting with a letter or digit "
    "(it becomes a directory name: no '/', no '..')"
)


class RunIdError(ValueError):
    """A run id that cannot be a directory name."""


def check_run_id(run_id: object) -> str:
    """``run_id`` if it is safe as one path component, else `RunIdError` saying the rule.
    The one check of run ids: the config, ``--run-id``, ``--resume`` and the paths here."""
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id) or ".." in run_id:
        raise RunIdError(f"bad run id {run_id!r}: use {RUN_ID_RULE}")
    return run_id


def cache_dir() -> Path:
    """The cache root: ``$GYRE_CACHE`` or ``~/.cache/gyre`` (``~`` expanded)."""
    return Path(os.environ.get("GYRE_CACHE") or "~/.cache/gyre").expanduser()


def spool_dir(store_url: str, run_id: str) -> Path:
    """Where a run's gateway keeps its write-ahead log (survives the process); keyed by
    store too, so the same run id on two stores never shares a log."""
    check_run_id(run_id)  # the last guard: never a spool outside the cache
    key = hashlib.sha256(store_url.encode()).hexdigest()[:12]
    return cache_dir() / "spool" / key / run_id


def serve_records_dir() -> Path:
    """Where each running ``gyre serve`` leaves its record (``<port>.json``)."""
    return cache_dir() / "serve"
