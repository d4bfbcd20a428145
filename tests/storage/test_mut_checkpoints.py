"""storage/checkpoints.py where generated mutants survived its other fast tests
(bench/mutation.py): the tokenizer fetched from a bucket (small files only, of the first
version), an interrupted copy in the cache never taken as complete (and moved aside without
a trace), and the weights digest: its exact format (digests recorded by earlier runs must
still compare equal), its file, and the store's copy."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid

import pytest
import torch

from storage.checkpoints import (
    _MARK,
    DIGEST_FILE,
    SHARDED_DIR,
    _cache_dest,
    _rename_into_place,
    checkpoint_relpath,
    commit_checkpoint,
    drop_optimizer_state,
    fetch_checkpoint,
    fetch_tokenizer,
    latest_version,
    publish_checkpoint,
    put_digest,
    read_commit,
    read_digest,
    stage_checkpoint,
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


# -- the cache's place, and what a fetch reads ----------------------------------------------


def test_the_cache_has_a_place_per_store_run_and_version(tmp_path, monkeypatch):
    store = Store(f"memory://gyre-mut-ckpt/{uuid.uuid4().hex[:8]}/p")
    flat = store.root.replace("/", "_")
    assert "/" not in flat and flat.count("_") == store.root.count("/")
    assert _cache_dest(store, "r1", "v3", "/c") == f"/c/{flat}/r1/v3"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert _cache_dest(store, "r1", "v3", None) == f"{tmp_path}/gyre-ckpt/{flat}/r1/v3"


def _bucket(files: dict[str, str], versions=(1,)) -> Store:
    store = Store(f"memory://gyre-mut-ckpt-{uuid.uuid4().hex}")
    for v in versions:
        for name, body in {**files, _MARK: "{}"}.items():
            store.write_bytes(f"{checkpoint_relpath('r1', v)}/{name}", body.encode())
    return store


def _counting_reads(monkeypatch, store: Store) -> list[str]:
    reads, read = [], store.read_bytes

    def counted(rel):
        reads.append(rel)
        return read(rel)

    monkeypatch.setattr(store, "read_bytes", counted)
    return reads


def test_a_cached_copy_is_read_once_and_downloaded_beside_its_place(tmp_path, monkeypatch):
    store = _bucket({"config.json": "{}", "model.safetensors": "w"})
    cache = tmp_path / "cache"
    seen = []
    reads, read = [], store.read_bytes

    def looking(rel):  # where the download is going while it goes
        seen.append(sorted(os.listdir(cache / store.root.replace("/", "_") / "r1")))
        reads.append(rel)
        return read(rel)

    monkeypatch.setattr(store, "read_bytes", looking)
    got = fetch_checkpoint(store, "r1", 1, cache_dir=str(cache))
    assert got == str(cache / store.root.replace("/", "_") / "r1" / "v1")
    assert len(reads) == 3  # COMPLETE, config.json, model.safetensors
    assert all(len(s) == 1 and s[0] != "v1" for s in seen), seen  # beside its place, alone
    reads.clear()
    assert fetch_checkpoint(store, "r1", 1, cache_dir=str(cache)) == got
    assert reads == []  # complete in the cache: not read again


def test_an_incomplete_copy_in_the_cache_is_fetched_again(tmp_path):
    store = _bucket({"config.json": "whole"})
    dest = _cache_dest(store, "r1", "v1", str(tmp_path))
    _dir(dest, {"config.json": "half"})  # an interrupted copy: no COMPLETE
    assert fetch_checkpoint(store, "r1", 1, cache_dir=str(tmp_path)) == dest
    with open(os.path.join(dest, "config.json")) as fh:
        assert fh.read() == "whole"
    assert os.path.exists(os.path.join(dest, _MARK))


def test_the_tokenizer_files_of_every_kind_are_fetched(tmp_path):
    names = ["tokenizer.json", "chat_template.jinja", "tokenizer.model", "merges.txt"]
    store = _bucket({**{n: n for n in names}, "model.safetensors": "w", "optimizer.pt": "o"})
    got = fetch_tokenizer(store, "r1", cache_dir=str(tmp_path))
    assert got == _cache_dest(store, "r1", "v1-tokenizer", str(tmp_path))
    assert sorted(os.listdir(got)) == sorted([*names, _MARK])


def test_a_local_stores_tokenizer_is_its_first_checkpoint_in_place(tmp_path):
    store = Store(str(tmp_path / "s"))
    for v in (3, 2):
        store.write_bytes(f"{checkpoint_relpath('r1', v)}/tokenizer.json", b"{}")
        store.write_bytes(f"{checkpoint_relpath('r1', v)}/{_MARK}", b"{}")
    assert fetch_tokenizer(store, "r1", cache_dir=str(tmp_path / "c")) == store.path(
        checkpoint_relpath("r1", 2)
    )
    assert not os.path.exists(tmp_path / "c")  # nothing copied


def test_a_run_without_checkpoints_has_no_tokenizer_and_no_latest_version(tmp_path):
    store = Store(str(tmp_path / "s"))
    with pytest.raises(FileNotFoundError) as got:
        fetch_tokenizer(store, "r9")
    assert str(got.value) == (
        f"run 'r9' has no checkpoint in {store.url}, so no tokenizer to decode its tokens with"
        " (a `gyre run` publishes v0 at its start, a `gyre serve` too)"
    )
    assert latest_version(store, "r9") is None


# -- dropping old optimizer state ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_old_versions_lose_their_optimizer_and_sharded_state_only(tmp_path, kind):
    store = (
        Store(str(tmp_path / "s"))
        if kind == "file"
        else Store(f"memory://gyre-mut-ckpt-{uuid.uuid4().hex}")
    )
    for v in (0, 1, 2, 3):
        rel = checkpoint_relpath("r1", v)
        for name in ("model.safetensors", "optimizer.pt", _MARK):
            store.write_bytes(f"{rel}/{name}", b"x")
        if v in (1, 3):  # train.sharding=fsdp
            for name in ("__0_0.distcp", ".metadata"):
                store.write_bytes(f"{rel}/{SHARDED_DIR}/{name}", b"s")
    store.write_bytes(f"{checkpoint_relpath('r1', 4)}/optimizer.pt", b"x")  # not committed
    assert drop_optimizer_state(store, "r1", below=3) == [0, 1, 2]
    for v in (0, 1, 2):
        assert store.listdir(checkpoint_relpath("r1", v)) == [_MARK, "model.safetensors"]
    assert store.listdir(checkpoint_relpath("r1", 3)) == [
        _MARK, "model.safetensors", "optimizer.pt", SHARDED_DIR
    ]  # fmt: skip
    assert store.listdir(f"{checkpoint_relpath('r1', 3)}/{SHARDED_DIR}") == [
        ".metadata", "__0_0.distcp"
    ]  # fmt: skip
    assert store.exists(f"{checkpoint_relpath('r1', 4)}/optimizer.pt")
    assert drop_optimizer_state(store, "r1", below=3) == []  # nothing left to drop


# -- the weights digest ----------------------------------------------------------------------


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a_emb = torch.nn.Embedding(5, 3)
        self.b_head = torch.nn.Linear(3, 5)
        self.b_head.weight = self.a_emb.weight  # tied, sorted after a_emb.weight
        self.c_out = torch.nn.Linear(5, 2)


def test_a_tied_tensor_counts_once_and_the_rest_all_count():
    m = _Tied()
    sd = m.state_dict()
    h = hashlib.sha256()
    for name in ["a_emb.weight", "b_head.bias", "c_out.bias", "c_out.weight"]:  # not b_head.weight
        t = sd[name]
        h.update(f"{name}|float32|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    assert weights_digest(m) == h.hexdigest()
    before = weights_digest(m)
    with torch.no_grad():
        m.c_out.weight[0, 0] += 1.0  # after the tied tensor in sorted order
    assert weights_digest(m) != before


def test_each_digest_is_the_models_own(tmp_path):
    a, b = _model(), _Tied()
    da = write_digest(a, _dir(tmp_path / "a", {}))
    db = write_digest(b, _dir(tmp_path / "b", {}))
    assert da == weights_digest(a) and db == weights_digest(b) and da != db
    assert len(da) == 64 and int(da, 16) >= 0
    assert read_digest(str(tmp_path / "a"))["sha256"] == da
    assert read_digest(str(tmp_path / "b"))["sha256"] == db
    store = Store(str(tmp_path / "store"))
    put_digest(store, "r1", 1, da, "bfloat16")
    raw = json.loads(store.read_bytes(f"{checkpoint_relpath('r1', 1)}/{DIGEST_FILE}"))
    assert raw == {"sha256": da, "dtype": "bfloat16"}


@pytest.mark.parametrize("body", ['{"dtype": "float32"}', "[1, 2]", '["sha256"]', "not json"])
def test_a_digest_file_that_is_not_a_digest_record_is_none(tmp_path, body):
    _dir(tmp_path / "c", {DIGEST_FILE: body})
    assert read_digest(str(tmp_path / "c")) is None


# -- placing a download, fetching a version -------------------------------------------------


def _renames(monkeypatch) -> list[tuple[str, str]]:
    done, rename = [], os.rename

    def spy(a, b):
        done.append((str(a), str(b)))
        return rename(a, b)

    monkeypatch.setattr(os, "rename", spy)
    return done


def test_an_incomplete_copy_is_moved_aside_beside_it_then_dropped(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    dest = _dir(cache / "v1", {"config.json": "half"})
    tmp = _dir(cache / ".v1-tmp-x", {"config.json": "whole", _MARK: "{}"})
    renames = _renames(monkeypatch)
    _rename_into_place(tmp, dest)
    assert len(renames) == 3  # tmp -> dest (refused: not empty), dest -> aside, tmp -> dest
    src, aside = renames[1]
    first = os.path.relpath(aside, cache).split(os.sep)[0]
    assert src == dest and first not in ("..", "v1")  # moved into a directory beside dest
    assert renames[2] == (tmp, dest) and sorted(os.listdir(cache)) == ["v1"]


def test_a_copy_that_cannot_be_placed_fails_after_three_tries(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    dest = _dir(cache / "v1", {"config.json": "half"})
    tmp = _dir(cache / ".v1-tmp-x", {_MARK: "{}"})
    placed = []

    def rename(a, b):
        if a == tmp:
            placed.append(b)
            raise OSError(39, "Directory not empty")
        raise FileNotFoundError(a)  # someone else moved the incomplete copy first

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError) as got:
        _rename_into_place(tmp, dest)
    assert str(got.value) == f"could not place checkpoint at {dest}"
    assert placed == [dest] * 3


def test_a_stale_copy_that_cannot_be_deleted_does_not_fail_the_fetch(tmp_path, monkeypatch):
    """A stale copy whose delete fails (NFS keeps an open file as .nfsXXXX: EBUSY) is left
    behind; the complete copy is placed all the same."""
    cache = tmp_path / "cache"
    dest = _dir(cache / "v1", {"config.json": "half"})
    tmp = _dir(cache / ".v1-tmp-x", {"config.json": "whole", _MARK: "{}"})
    rmtree = shutil.rmtree

    def busy(path, ignore_errors=False, **kw):
        if ".stale-" not in str(path):
            return rmtree(path, ignore_errors=ignore_errors, **kw)
        if not ignore_errors:
            raise OSError(16, "Device or resource busy", str(path))

    monkeypatch.setattr(shutil, "rmtree", busy)
    _rename_into_place(tmp, dest)
    with open(os.path.join(dest, "config.json")) as fh:
        assert fh.read() == "whole"


def test_a_fetch_takes_the_optimizer_state_only_when_asked(tmp_path):
    store = _bucket({"model.safetensors": "w", "optimizer.pt": "o"})
    plain = fetch_checkpoint(store, "r1", 1, cache_dir=str(tmp_path / "a"))
    assert sorted(os.listdir(plain)) == [_MARK, "model.safetensors"]
    full = fetch_checkpoint(store, "r1", 1, cache_dir=str(tmp_path / "b"), with_optimizer=True)
    assert sorted(os.listdir(full)) == [_MARK, "model.safetensors", "optimizer.pt"]


def test_a_fetch_with_the_optimizer_after_one_without_gets_it_from_the_same_cache(tmp_path):
    """A rollout cell's engine fetches v1's weights; the same cell, moved to training, then
    restores a replica at v1 with its AdamW state: the cached copy without it must not
    answer (the trainer would start a fresh AdamW, with a warning only), and the weights-only
    copy stays as it was for the engine still reading it."""
    store = _bucket({"model.safetensors": "w", "optimizer.pt": "o"})
    cache = str(tmp_path / "cache")
    plain = fetch_checkpoint(store, "r1", 1, cache_dir=cache)
    full = fetch_checkpoint(store, "r1", 1, cache_dir=cache, with_optimizer=True)
    assert sorted(os.listdir(full)) == [_MARK, "model.safetensors", "optimizer.pt"]
    assert sorted(os.listdir(plain)) == [_MARK, "model.safetensors"]
    assert fetch_checkpoint(store, "r1", 1, cache_dir=cache) == plain
    assert fetch_checkpoint(store, "r1", 1, cache_dir=cache, with_optimizer=True) == full


def test_a_version_not_committed_is_refused_and_a_local_one_is_read_in_place(tmp_path):
    store = Store(str(tmp_path / "s"))
    store.write_bytes(f"{checkpoint_relpath('r1', 1)}/model.safetensors", b"w")
    with pytest.raises(FileNotFoundError) as got:
        fetch_checkpoint(store, "r1", 1, cache_dir=str(tmp_path / "c"))
    assert str(got.value) == f"checkpoint v1 is not complete in {store.url}"
    store.write_bytes(f"{checkpoint_relpath('r1', 1)}/{_MARK}", b"1")
    got_dir = fetch_checkpoint(store, "r1", 1, cache_dir=str(tmp_path / "c"))
    assert got_dir == store.path(checkpoint_relpath("r1", 1))
    assert not os.path.exists(tmp_path / "c")  # nothing copied


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_staging_and_committing_name_the_versions_url_and_the_marker_holds_it(tmp_path, kind):
    store = (
        Store(str(tmp_path / "s"))
        if kind == "file"
        else Store(f"memory://gyre-mut-ckpt-{uuid.uuid4().hex}")
    )
    src = _dir(tmp_path / "ck", {"model.safetensors": "w"})
    want = f"{store.url}/checkpoints/r1/v3"
    assert stage_checkpoint(store, "r1", src, 3) == want
    assert latest_version(store, "r1") is None  # staged, not visible
    assert commit_checkpoint(store, "r1", 3) == want
    assert store.read_bytes(f"{checkpoint_relpath('r1', 3)}/{_MARK}") == b"3"  # the version
    assert latest_version(store, "r1") == 3 and read_commit(store, "r1", 3) is None
    assert publish_checkpoint(store, "r1", src, 4) == f"{store.url}/checkpoints/r1/v4"
    commit_checkpoint(store, "r1", 5, {"step": 4})
    assert read_commit(store, "r1", 5) == {"version": 5, "step": 4}
