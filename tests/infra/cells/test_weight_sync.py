"""Fast: after a cell loads version v, its engine serves checkpoint v's weights.

The engine reports a digest of the weights it serves (``/get_model_info``
``weights_digest``); here it is compared with a digest of checkpoint v's weights computed
independently (the files loaded by transformers, hashed by this test's own loop), and must
differ from v-1's. A checkpoint whose recorded digest disagrees with what the engine then
serves makes the load fail (infra/cells/engines.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from types import SimpleNamespace

import pytest
import torch

from infra.cells.engines import load_weights
from infra.engine.engine import Engine
from infra.engine.server import EngineServer
from infra.engine.tiny_model import make_tiny_model
from infra.engine_api.client import EngineClient
from storage.checkpoints import DIGEST_FILE, fetch_checkpoint, publish_checkpoint
from storage.store import Store
from tasks.train.trainer import Trainer

pytestmark = pytest.mark.integration

RUN = "ws"


def digest_of_checkpoint(path: str) -> str:
    """sha256 over the checkpoint's tensors as transformers loads them: sorted names, dtype,
    shape, bytes; a tied tensor counted once (the engine's format, written out here)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sd = model.state_dict()
    h, seen = hashlib.sha256(), set()
    for name in sorted(sd):
        t = sd[name]
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws")
    store = Store(str(root / "store"))
    v0 = make_tiny_model()
    publish_checkpoint(store, RUN, v0, 0)
    trainer = Trainer(v0)
    for v in (1, 2):  # versions a trainer made: other weights, each with its digest
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        trainer.version = v
        out = trainer.save(str(root / f"v{v}"))
        publish_checkpoint(store, RUN, out, v)
    engine = Engine(v0, cell_id="c0")
    server = EngineServer(engine)
    url = server.start()
    yield store, SimpleNamespace(engine=engine, engine_url=url)
    server.stop()
    engine.close()


def _served_digest(url: str) -> str:
    async def ask():
        async with EngineClient(url) as c:
            return await c.weights_digest()

    return asyncio.run(ask())[0]


def test_the_engine_serves_the_labelled_checkpoint(served):
    store, plugin = served
    want = {v: digest_of_checkpoint(fetch_checkpoint(store, RUN, v)) for v in (0, 1, 2)}
    assert len(set(want.values())) == 3
    assert _served_digest(plugin.engine_url) == want[0]
    for v in (1, 2):
        res = load_weights(plugin, store, RUN, v)
        assert res["success"], res
        assert plugin.engine.weight_version == v
        got = _served_digest(plugin.engine_url)
        assert got == want[v], f"v{v} is served with other weights"
        assert got != want[v - 1]
        # the trainer's recorded digest is the same number
        with open(os.path.join(fetch_checkpoint(store, RUN, v), DIGEST_FILE)) as fh:
            assert json.load(fh)["sha256"] == want[v]


def test_a_digest_mismatch_fails_the_load(served, tmp_path):
    store, plugin = served
    bad = Store(str(tmp_path / "bad"))
    src = fetch_checkpoint(store, RUN, 1)
    publish_checkpoint(bad, RUN, src, 1)
    path = fetch_checkpoint(bad, RUN, 1)
    with open(os.path.join(path, DIGEST_FILE)) as fh:
        rec = json.load(fh)
    with open(os.path.join(path, DIGEST_FILE), "w") as fh:
        json.dump({**rec, "sha256": "0" * 64}, fh)
    res = load_weights(plugin, bad, RUN, 1)
    assert not res["success"] and "serves weights" in res["message"], res
