"""The engine of a rollout cell: start it in the cell's process, load new weights.

These run inside a cell through ``Cells.run_on(address, fn, ...)``, which hands
them the cell's ``CellPlugin``. Weight loads go through the engine client
(``/update_weights_from_disk``), the same verb an SGLang server takes, so a cell
backed by SGLang is driven the same way.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from infra.engine_api.client import EngineClient
from storage.checkpoints import fetch_checkpoint
from storage.store import Store

log = logging.getLogger(__name__)


def start_engine(
    plugin: Any,
    model_dir: str,
    *,
    cell_id: str,
    weight_version: int = 0,
    max_batch_size: int = 16,
    kv_cache_tokens: int = 262_144,
    audit_dir: str | None = None,
) -> str:
    """Start (once) the embedded engine and its HTTP server in this cell; returns its URL.

    ``audit_dir``: the engine appends every request it admits to
    ``{audit_dir}/{cell_id}.jsonl`` (config ``model.audit_dir``).
    """
    from infra.engine.engine import Engine
    from infra.engine.server import EngineServer

    with plugin.lock:
        if plugin.server is None:
            plugin.engine = Engine(
                model_dir,
                weight_version=weight_version,
                max_batch_size=max_batch_size,
                kv_cache_tokens=kv_cache_tokens,
                cell_id=cell_id,
                audit_path=os.path.join(audit_dir, f"{cell_id}.jsonl") if audit_dir else None,
            )
            plugin.server = EngineServer(plugin.engine, host="127.0.0.1", port=0)
            plugin.engine_url = plugin.server.start()
        return plugin.engine_url


def load_weights(plugin: Any, store: Store, run_id: str, version: int) -> dict[str, Any]:
    """Fetch checkpoint ``version`` to this cell and swap it into the engine."""
    path = fetch_checkpoint(store, run_id, version)

    async def update() -> dict[str, Any]:
        async with EngineClient(plugin.engine_url) as client:
            return await client.update_weights_from_disk(path, version, flush_cache=True)

    return asyncio.run(update())
