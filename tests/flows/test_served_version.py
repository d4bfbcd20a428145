"""`gyre serve` records the version of the weights it loaded, from their digest.

Issue 26: `gyre serve --model <store>/checkpoints/serve/v1` answered with v1's weights but
stored every call as weight_version=0. The version comes from matching the loaded weights
against the run's committed checkpoints (flows/serve.py ``served_version``)."""

from __future__ import annotations

import shutil

import pytest
import torch

from flows.serve import ServeError, served_version
from infra.engine.engine import Engine
from infra.engine.tiny_model import make_tiny_model
from storage.checkpoints import checkpoint_relpath, publish_checkpoint, stored_digest, write_digest
from storage.store import Store


def _trained_copy(src: str, dst) -> str:
    """The tiny model with every weight moved a little, saved as a trainer saves (digest)."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    model.save_pretrained(dst)
    write_digest(model, str(dst))
    return str(dst)


def test_the_served_version_is_the_checkpoint_whose_weights_were_loaded(tmp_path):
    store = Store(str(tmp_path / "store"))
    v0 = make_tiny_model()
    publish_checkpoint(store, "serve", v0, 0)  # copied in without a digest, as a model is
    publish_checkpoint(store, "serve", _trained_copy(v0, tmp_path / "v1"), 1)
    served_v1 = store.path(checkpoint_relpath("serve", 1))  # the path the README prints

    engine = Engine(served_v1, cell_id="serve")
    try:
        v = served_version(store, "serve", engine, served_v1)
        engine.name_version(v)
        assert v == 1
        assert engine.model_info()["weight_version"] == "1"
    finally:
        engine.close()

    engine = Engine(v0, cell_id="serve")
    try:
        assert served_version(store, "serve", engine, v0) == 0
        assert stored_digest(store, "serve", 0) == engine.weights_digest()  # computed, kept
    finally:
        engine.close()


def test_weights_of_no_committed_version_are_refused(tmp_path):
    store = Store(str(tmp_path / "store"))
    publish_checkpoint(store, "serve", make_tiny_model(), 0)
    other = make_tiny_model(seed=1)
    engine = Engine(other, cell_id="serve")
    try:
        with pytest.raises(ServeError, match="none of run 'serve'"):
            served_version(store, "serve", engine, other)
    finally:
        engine.close()
