"""Live machinery of the runs in this process (cells, gateway), by run id.

The loop subflow looks its machinery up here instead of taking it as a
parameter or a module global: Prefect ships a flow's parameters with every task
it submits to Dask and Dask pickles the flow function by value, and a gateway or
a Dask client cannot travel. Functions of an importable module are pickled by
reference, so this registry never leaves the process.
"""

from __future__ import annotations

from typing import Any

_LIVE: dict[str, tuple[Any, ...]] = {}


def register(run_id: str, *objects: Any) -> None:
    _LIVE[run_id] = objects


def lookup(run_id: str) -> tuple[Any, ...]:
    return _LIVE[run_id]


def drop(run_id: str) -> None:
    _LIVE.pop(run_id, None)
