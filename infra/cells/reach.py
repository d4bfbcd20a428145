"""What every cell must reach from its own host before a run starts: the store.

Cells on other hosts share nothing with the run's host but the network: no loopback, no
``/tmp``, no local disk. Everything a cell reads or writes goes through the store (S3, or a
directory that is the same shared path on every host), each host with its own local
cache. A cell that cannot reach the store, or that sees a different one (a local
directory of the same name on another host), would fail later in the middle of a task with
a store error that names no host; this check fails first, naming each such cell, its host
and what it saw.
"""

from __future__ import annotations

import socket
from typing import Any

from infra.cells.cluster import Cells, cell_name, host_of
from storage.checkpoints import checkpoint_relpath
from storage.store import Store

PROBE_RETRY_S = 30.0  # a cell waits this long for the store before it is reported


class StoreUnreachable(RuntimeError):
    """A cell's host cannot reach the run's store, or sees another store under its URL."""


def check_store(cells: Cells, store: Store, run_id: str, retry_s: float = PROBE_RETRY_S) -> None:
    """Each cell opens ``store`` from its own host and finds the run's checkpoint v0 (which
    the run publishes before its cells start); raises `StoreUnreachable` naming every cell
    that cannot, with its host."""
    marker = f"{checkpoint_relpath(run_id, 0)}/COMPLETE"  # storage/checkpoints.py's marker
    out = cells.client.run(
        _probe,
        store.url,
        store.storage_options,
        marker,
        min(retry_s, store.retry_s),
        workers=sorted(cells.roles),
        on_error="return",
    )
    bad = []
    for addr in sorted(cells.roles):
        why = out.get(addr, "did not answer")
        if isinstance(why, BaseException):
            why = f"{type(why).__name__}: {why}"
        if why is not None:
            bad.append(f"cell {cell_name(addr)} on host {host_of(addr)}: {why}")
    if bad:
        raise StoreUnreachable(
            f"the run's store {store.url} is not usable from every cell's host (each needs "
            "it, a shared path or s3://, with credentials and endpoint):\n  " + "\n  ".join(bad)
        )


def _probe(url: str, options: dict[str, Any], marker: str, retry_s: float) -> str | None:
    """On a cell: None if the store is there with the run's files, else why not (a string:
    a raised StoreError would carry an outage into the run's process, which can reach it)."""
    where = socket.gethostname()
    try:
        st = Store(url, options, create=False, retry_s=retry_s)
        if not st.exists(marker):
            return (
                f"the store at {url} is there but does not hold this run's files ({marker}) "
                f"as seen from {where}: a directory store must be one shared path on every host"
            )
    except Exception as exc:
        return f"cannot reach the store from {where}: {type(exc).__name__}: {exc}"
    return None
