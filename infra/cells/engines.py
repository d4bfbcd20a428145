"""The engine of a rollout cell: start it in the cell's process, park it, load new weights.

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

from infra.cells.cluster import host_of
from infra.cells.config import LOOPBACK, is_loopback
from infra.engine_api.client import EngineClient
from storage.checkpoints import fetch_checkpoint, read_digest
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
    decode_step_s: float = 0.0,
    prefill_tokens_per_s: float = 0.0,
    store: Store | None = None,
    run_id: str | None = None,
) -> str:
    """Start (once) the embedded engine and its HTTP server in this cell; returns its URL.

    A cell that left the rollout role keeps its engine parked (see ``park_engine``), so a
    return to rollout only loads new weights. ``audit_dir``: the engine appends every
    request it admits to ``{audit_dir}/{cell_id}.jsonl`` (config ``model.audit_dir``).
    ``decode_step_s`` / ``prefill_tokens_per_s``: paced device time (infra/cells/pacing.py).
    ``model_dir`` is a path on the run's host; a cell on a host that does not have it
    starts from the run's checkpoint v0 in ``store`` instead (the same weights, published
    before any cell starts), fetched into this host's own cache.
    """
    from infra.cells.pacing import PacedEngine
    from infra.engine.engine import Engine
    from infra.engine.server import EngineServer

    with plugin.lock:
        if plugin.server is None:
            if not os.path.isdir(model_dir) and store is not None and run_id is not None:
                model_dir = fetch_checkpoint(store, run_id, 0)
            kw = {
                "weight_version": weight_version,
                "max_batch_size": max_batch_size,
                "kv_cache_tokens": kv_cache_tokens,
                "cell_id": cell_id,
                "audit_path": os.path.join(audit_dir, f"{cell_id}.jsonl") if audit_dir else None,
            }
            if decode_step_s or prefill_tokens_per_s:
                plugin.engine = PacedEngine(
                    model_dir,
                    decode_step_s=decode_step_s,
                    prefill_tokens_per_s=prefill_tokens_per_s,
                    **kw,
                )
            else:
                plugin.engine = Engine(model_dir, **kw)
            # the engine listens where its worker does: the address the other hosts reach
            # this cell by (loopback for a one-host run); beyond loopback it takes calls
            # with the run's token only
            where = getattr(plugin, "worker_address", "")  # tests may pass bare holders
            host = host_of(where) if where else LOOPBACK
            key = None if is_loopback(host) else getattr(plugin, "token", None)
            if key is None and not is_loopback(host):
                raise RuntimeError(
                    f"cell {cell_id}: its engine would listen on {host} with no token; "
                    "start the cells with the run's token (start_cells(token=...))"
                )
            plugin.server = EngineServer(plugin.engine, host=host, port=0, api_key=key)
            plugin.engine_url = plugin.server.start()
        return plugin.engine_url


def load_weights(plugin: Any, store: Store, run_id: str, version: int) -> dict[str, Any]:
    """Fetch checkpoint ``version`` to this cell and swap it into the engine.

    Calls in flight are aborted and resubmitted by the gateway with their partial output
    (the harness sees nothing), so no recorded call claims a newer version than its oldest
    token: policy lag is never under-counted. When the checkpoint carries the trainer's
    weights digest and the engine reports one (of the same dtype), they must be equal: an
    engine serving other weights under this version's label is a failed load.
    """
    path = fetch_checkpoint(store, run_id, version)
    want = read_digest(path)

    async def update() -> dict[str, Any]:
        async with EngineClient(plugin.engine_url, token=getattr(plugin, "token", None)) as client:
            res = await client.update_weights_from_disk(
                path, version, abort_all_requests=True, flush_cache=True
            )
            if not res.get("success", False) or want is None:
                return res
            got, dtype = await client.weights_digest()
            if got is not None and dtype == want.get("dtype") and got != want["sha256"]:
                return {
                    "success": False,
                    "message": f"after loading {path} as v{version} the engine serves weights "
                    f"{got[:16]}, but checkpoint v{version} holds {want['sha256'][:16]}",
                }
            return res

    return asyncio.run(update())


def park_engine(plugin: Any) -> dict[str, Any]:
    """A cell leaving the rollout role keeps its engine, with an empty KV cache (the memory
    goes to training); returns the engine's load for the record."""
    eng = plugin.engine
    if eng is None:
        return {}
    eng.flush_cache()
    load = eng.load()
    return {"paced_s": getattr(eng, "paced_s", 0.0), **load}


def engine_stats(plugin: Any) -> dict[str, Any]:
    """The cell's engine counters (decode steps, prefill tokens, paced device time)."""
    eng = plugin.engine
    if eng is None:
        return {}
    return {"paced_s": getattr(eng, "paced_s", 0.0), **eng.load()}
