"""The engine of a rollout cell: start it in the cell's process, load new weights.

These run inside a cell through ``Cells.run_on(address, fn, ...)``, which hands
them the cell's ``CellPlugin``. Weight loads go through the engine's own HTTP
API (``/update_weights_from_disk``), the same verb an SGLang server takes, so a
cell backed by SGLang is driven the same way.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

import httpx

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
) -> str:
    """Start (once) the embedded engine and its HTTP server in this cell; returns its URL."""
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
            )
            audit_dir = os.environ.get("GYRE_ENGINE_AUDIT_DIR")
            if audit_dir:
                audit_inputs(plugin.engine, os.path.join(audit_dir, f"{cell_id}.jsonl"))
            plugin.server = EngineServer(plugin.engine, host="127.0.0.1", port=0)
            plugin.engine_url = plugin.server.start()
        return plugin.engine_url


def audit_inputs(engine: Any, path: str) -> None:
    """Append every request the engine receives (rid, input ids) to a JSONL file.

    For audits and tests of token exactness: what the engine was asked is then
    comparable with what the gateway recorded in TITO. Set GYRE_ENGINE_AUDIT_DIR.
    """
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fh = open(path, "a")  # noqa: SIM115  (lives as long as the engine)
    lock = threading.Lock()
    submit = engine.submit

    def audited_submit(input_ids, *args, **kwargs):
        req = submit(input_ids, *args, **kwargs)
        line = json.dumps({"rid": req.rid, "input_ids": [int(t) for t in req.input_ids]})
        with lock:
            fh.write(line + "\n")
            fh.flush()
        return req

    engine.submit = audited_submit


def load_weights(plugin: Any, store: Store, run_id: str, version: int) -> dict[str, Any]:
    """Fetch checkpoint ``version`` to this cell and swap it into the engine."""
    path = fetch_checkpoint(store, run_id, version)
    r = httpx.post(
        f"{plugin.engine_url}/update_weights_from_disk",
        json={"model_path": path, "weight_version": str(version), "flush_cache": True},
        timeout=600,
    )
    r.raise_for_status()
    body = r.json()
    if not body.get("success", False):
        raise RuntimeError(f"engine refused v{version}: {body.get('message')}")
    return body
