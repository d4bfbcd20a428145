"""Local directories gyre keeps outside the store, all under one cache root.

``GYRE_CACHE`` (default ``~/.cache/gyre``) is the one environment variable that
places them; it is read here and nowhere else:

- ``models/``  the tiny model and tokenizer, made locally on first use;
- ``spool/<run_id>/``  a run's gateway write-ahead log and session-key journal
  (replayed into the store by the next gateway opened on it);
- ``serve.json``  the record of a running ``gyre serve``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache root: ``$GYRE_CACHE`` or ``~/.cache/gyre`` (``~`` expanded)."""
    return Path(os.environ.get("GYRE_CACHE") or "~/.cache/gyre").expanduser()


def spool_dir(run_id: str) -> Path:
    """Where a run's gateway keeps its write-ahead log (survives the process)."""
    return cache_dir() / "spool" / run_id
