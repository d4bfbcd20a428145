"""storage/checkpoints.py where generated mutants survived its other fast tests
(bench/mutation.py): the tokenizer fetched from a bucket (small files only, of the first
version), an interrupted copy in the cache never taken as complete (and moved aside without
a trace), and the weights digest: its exact format (digests recorded by earlier runs must
still compare equal), its file, and the store's copy."""

from __future__ import annotations

import hashlib
import json
import os
import uuid

import torch

from storage.checkpoints import (
    _MARK,
    DIGEST_FILE,
    _rename_into_place,
    checkpoint_relpath,
    fetch_tokenizer,
    put_digest,
    read_digest,
    stored_digest,
    weights_digest,
    write_digest,
)
from storage.store import Store


def _bucket_with_versions(*versions: int) -> Store:
    store = Store(f"memory://gyre-mut-ckpt-{uuid.uuid4().hex}")
    for v in versions:
        rel = checkpoint_relpath("r1", v)
        for name, body in [
            ("tokenizer.json", f'{{"v": {v}}}'),
            ("tokenizer_config.json", "{}"),
            ("chat_template.jinja", "{{ x }}"),
            ("model.safetensors", "weights"),
            (_MARK, "{}"),
        ]:
            store.write_bytes(f"{rel}/{name}", body.encode())
    return store


def test_the_tokenizer_of_the_first_version_is_fetched_without_weights(tmp_path):
    store = _bucket_with_versions(2, 1)
    got = fetch_tokenizer(store, "r1", cache_dir=str(tmp_path))
    assert os.path.basename(got) == "v1-tokenizer"
    assert sorted(os.listdir(got)) == sorted(
        ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", _MARK]
    )
    with open(os.path.join(got, "tokenizer.json")) as fh:
        assert json.load(fh) == {"v": 1}
    assert fetch_tokenizer(store, "r1", cache_dir=str(tmp_path)) == got  # cached


def _dir(path, files: dict[str, str]) -> str:
    os.makedirs(path)
    for name, body in files.items():
        with open(os.path.join(path, name), "w") as fh:
            fh.write(body)
    return str(path)


def test_an_interrupted_copy_is_replaced_and_leaves_nothing_behind(tmp_path):
    dest = _dir(tmp_path / "cache" / "v1", {"config.json": "half"})  # no COMPLETE: interrupted
    tmp = _dir(tmp_path / "cache" / ".v1-tmp-x", {"config.json": "whole", _MARK: "{}"})
    _rename_into_place(tmp, dest)
    assert sorted(os.listdir(dest)) == ["COMPLETE", "config.json"]
    with open(os.path.join(dest, "config.json")) as fh:
        assert fh.read() == "whole"
    assert sorted(os.listdir(tmp_path / "cache")) == ["v1"]  # no .stale- copy left


def test_a_complete_copy_stands(tmp_path):
    dest = _dir(tmp_path / "cache" / "v1", {"config.json": "theirs", _MARK: "{}"})
    tmp = _dir(tmp_path / "cache" / ".v1-tmp-x", {"config.json": "ours", _MARK: "{}"})
    _rename_into_place(tmp, dest)
    with open(os.path.join(dest, "config.json")) as fh:
        assert fh.read() == "theirs"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 3))
    return m


def test_the_digest_format_is_fixed():
    m = _model()
    h = hashlib.sha256()
    for name, t in sorted(m.state_dict().items()):
        h.update(f"{name}|float32|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    assert weights_digest(m) == h.hexdigest()


def test_the_digest_file_and_the_stores_copy(tmp_path):
    m = _model()
    d = write_digest(m, str(tmp_path))
    assert read_digest(str(tmp_path)) == {"sha256": d, "dtype": "float32"}
    store = Store(str(tmp_path / "store"))
    assert stored_digest(store, "r1", 1) is None
    put_digest(store, "r1", 1, d, "float32")
    assert stored_digest(store, "r1", 1) == d
    store.write_bytes(f"{checkpoint_relpath('r1', 2)}/{DIGEST_FILE}", b"[1, 2]")
    assert stored_digest(store, "r1", 2) is None  # not a record
