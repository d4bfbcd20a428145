"""Local directories gyre keeps outside the store, all under one cache root.

``GYRE_CACHE`` (default ``~/.cache/gyre``) is the one environment variable that
places them; it is read here and nowhere else:

- ``models/``  the tiny model and tokenizer, made locally on first use;
- ``spool/<store-key>/<run_id>/``  a run's gateway write-ahead log and session-key
  journal, one per store and run (replayed into the store by the next gateway opened
  on it: ``gyre serve`` or ``gyre run`` with the same store and run id);
- ``serve/<port>.json``  the record of a running ``gyre serve`` (one per port).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache root: ``$GYRE_CACHE`` or ``~/.cache/gyre`` (``~`` expanded)."""
    return Path(os.environ.get("GYRE_CACHE") or "~/.cache/gyre").expanduser()


def spool_dir(store_url: str, run_id: str) -> Path:
    """Where a run's gateway keeps its write-ahead log (survives the process); keyed by
    store too, so the same run id on two stores never shares a log."""
    key = hashlib.sha256(store_url.encode()).hexdigest()[:12]
    return cache_dir() / "spool" / key / run_id


def serve_records_dir() -> Path:
    """Where each running ``gyre serve`` leaves its record (``<port>.json``)."""
    return cache_dir() / "serve"
