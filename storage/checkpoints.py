"""Versioned checkpoints in the store: ``checkpoints/{run_id}/v{N}/`` (safetensors + config +
tokenizer, and the trainer's optimizer state).

A checkpoint exists once its ``COMPLETE`` marker does (written last, in one atomic write),
so an engine never loads a half-copied version. Version 0 is the initial model. For a
version made by an optimizer step the marker is also the step's *commit record*
(storage/commits.py): the files are staged first (``stage_checkpoint``), then one write of
the marker commits the checkpoint, the step, and the samples it consumed together.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable

from storage.store import Store

_MARK = "COMPLETE"
# a version's sharded training state (train.sharding=fsdp: torch.distributed.checkpoint
# files, one per member, and their .metadata), staged with the version, committed by its
# marker: tasks/train/sharded.py
SHARDED_DIR = "sharded"
_VDIR = re.compile(r"^v(\d+)$")


def checkpoint_relpath(run_id: str, version: int) -> str:
    return f"checkpoints/{run_id}/v{int(version)}"


def publish_checkpoint(store: Store, run_id: str, local_dir: str, version: int) -> str:
    """Copy a local checkpoint dir into the store as ``version``; returns its store URL."""
    stage_checkpoint(store, run_id, local_dir, version)
    return commit_checkpoint(store, run_id, version)


def stage_checkpoint(store: Store, run_id: str, local_dir: str, version: int) -> str:
    """Copy a checkpoint's files into the store, not yet visible (no marker); a later
    attempt of the same version overwrites them. Returns the store URL it will have."""
    rel = checkpoint_relpath(run_id, version)
    store.put_dir(local_dir, rel)
    return store.full_url(rel)


def commit_checkpoint(store: Store, run_id: str, version: int, record: dict | None = None) -> str:
    """Make a staged checkpoint visible: one atomic write of its marker, which carries
    ``record`` (a step's commit record) when given. Returns the checkpoint's store URL."""
    rel = checkpoint_relpath(run_id, version)
    body = str(version) if record is None else json.dumps({"version": version, **record})
    store.write_bytes(f"{rel}/{_MARK}", body.encode())
    return store.full_url(rel)


def drop_optimizer_state(store: Store, run_id: str, below: int) -> list[int]:
    """Delete the optimizer state of committed versions older than ``below`` (and their
    sharded training state, ``sharded/``, under train.sharding=fsdp); returns them.

    Only a step's start version's optimizer state is ever read (``restore_trainer``: a step,
    its retry, a DP joiner and ``--resume`` all start from the newest version), so older
    versions keep their weights (for evaluation, serving, export) but not the state, which
    is twice the weights under AdamW: a 135M model in fp32 wrote 1.6 GB a step, 0.54 GB of
    it weights."""
    dropped = []
    for v in versions(store, run_id):
        if v >= below:
            break
        rel = checkpoint_relpath(run_id, v)
        names = [n for n in store.listdir(rel) if n.startswith("optimizer")]
        if SHARDED_DIR in store.listdir(rel):  # train.sharding=fsdp: weights + AdamW shards
            names += [f"{SHARDED_DIR}/{n}" for n in store.listdir(f"{rel}/{SHARDED_DIR}")]
        if any([store.remove(f"{rel}/{n}") for n in names]):  # remove: one file each
            dropped.append(v)
        if store.protocol == "file":  # an object store has no empty directory to leave
            with contextlib.suppress(OSError):
                os.rmdir(store.path(f"{rel}/{SHARDED_DIR}"))
    return dropped


def read_commit(store: Store, run_id: str, version: int) -> dict | None:
    """The commit record in version ``version``'s marker; None if the version is not
    committed or was not made by a step (version 0, a copied model)."""
    try:
        body = store.read_bytes(f"{checkpoint_relpath(run_id, version)}/{_MARK}")
    except FileNotFoundError:
        return None
    try:
        rec = json.loads(body)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def versions(store: Store, run_id: str) -> list[int]:
    out = []
    for name in store.listdir(f"checkpoints/{run_id}"):
        m = _VDIR.match(name)
        if m and store.exists(f"checkpoints/{run_id}/{name}/{_MARK}"):
            out.append(int(m.group(1)))
    return sorted(out)


def latest_version(store: Store, run_id: str) -> int | None:
    vs = versions(store, run_id)
    return vs[-1] if vs else None


def fetch_checkpoint(
    store: Store,
    run_id: str,
    version: int,
    cache_dir: str | None = None,
    *,
    with_optimizer: bool = False,
) -> str:
    """A local directory holding checkpoint ``version`` (no copy when the store is local)."""
    rel = checkpoint_relpath(run_id, version)
    if not store.exists(f"{rel}/{_MARK}"):
        raise FileNotFoundError(f"checkpoint v{version} is not complete in {store.url}")
    if store.protocol == "file":
        return store.path(rel)
    # a copy with the optimizer state has a directory of its own: a weights-only copy (an
    # engine's) must never answer for it, and a complete copy is never changed in place
    leaf = f"v{version}-optimizer" if with_optimizer else f"v{version}"
    return _cached_copy(
        store,
        rel,
        _cache_dest(store, run_id, leaf, cache_dir),
        # the sharded state is read in place by its members (sharded.load_sharded), never
        # copied: a directory, which this flat copy cannot hold
        lambda name: name != SHARDED_DIR and (with_optimizer or not name.startswith("optimizer")),
    )


def fetch_tokenizer(store: Store, run_id: str, cache_dir: str | None = None) -> str:
    """A local directory with the tokenizer (and config) of ``run_id``'s first checkpoint:
    the model its calls were tokenised with. A local store's own directory; from a bucket,
    the small files only (no weights), cached."""
    vs = versions(store, run_id)
    if not vs:
        raise FileNotFoundError(
            f"run {run_id!r} has no checkpoint in {store.url}, so no tokenizer to decode its "
            "tokens with (a `gyre run` publishes v0 at its start, a `gyre serve` too)"
        )
    rel = checkpoint_relpath(run_id, vs[0])
    if store.protocol == "file":
        return store.path(rel)
    return _cached_copy(
        store,
        rel,
        _cache_dest(store, run_id, f"v{vs[0]}-tokenizer", cache_dir),
        lambda name: name.endswith((".json", ".jinja", ".model", ".txt")) or name == _MARK,
    )


def _cache_dest(store: Store, run_id: str, leaf: str, cache_dir: str | None) -> str:
    """Where this host caches ``leaf`` of ``run_id``'s checkpoints from ``store``."""
    cache_dir = cache_dir or os.path.join(tempfile.gettempdir(), "gyre-ckpt")
    return os.path.join(cache_dir, store.root.replace("/", "_"), run_id, leaf)


def _cached_copy(store: Store, rel: str, dest: str, keep: Callable[[str], bool]) -> str:
    """``dest``, holding the files of the store's directory ``rel`` that ``keep`` accepts
    (its completion marker among them), downloaded unless a complete copy is there."""
    if os.path.exists(os.path.join(dest, _MARK)):
        return dest
    # Other processes may fetch the same version at once, and one may already be loading
    # from ``dest``: download into a directory of our own beside it, then rename it into
    # place in one step. The loser of that race drops its copy; a complete ``dest`` is never
    # deleted or changed.
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(dest), prefix=f".{os.path.basename(dest)}-tmp-")
    try:
        for name in store.listdir(rel):
            if keep(name):
                with open(os.path.join(tmp, name), "wb") as fh:
                    fh.write(store.read_bytes(f"{rel}/{name}"))
        _rename_into_place(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone when renamed; ours alone otherwise
    return dest


def _rename_into_place(tmp: str, dest: str) -> None:
    """Rename the complete directory ``tmp`` to ``dest`` unless a complete ``dest`` is there
    already (then ``tmp`` is left for the caller to drop). An incomplete ``dest`` (an
    interrupted copy of an older gyre) is moved aside first, never read from."""
    for _ in range(3):
        try:
            os.rename(tmp, dest)  # atomic; fails if dest is a non-empty directory
            return
        except OSError:
            if os.path.exists(os.path.join(dest, _MARK)):
                return  # another process won the race: its copy stands
            aside = tempfile.mkdtemp(dir=os.path.dirname(dest), prefix=".stale-")
            with contextlib.suppress(FileNotFoundError):  # someone else moved it first
                os.rename(dest, os.path.join(aside, "d"))
            shutil.rmtree(aside, ignore_errors=True)
    raise OSError(f"could not place checkpoint at {dest}")


DIGEST_FILE = "weights.json"


def weights_digest(model) -> str:
    """sha256 of a model's weights: every tensor of ``model.state_dict()`` by name (sorted),
    with its dtype, shape and bytes; a tensor tied to one already hashed (a tied ``lm_head``)
    counts once. Equal for two models iff they compute with the same numbers, whatever file
    or process they were loaded in: what an engine serves can be checked against what the
    trainer saved (``DIGEST_FILE`` in a checkpoint, infra/cells/engines.py)."""
    import hashlib

    import torch

    h = hashlib.sha256()
    seen = set()
    sd = model.state_dict()
    for name in sorted(sd):
        t = sd[name].detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode())
        h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_digest(model, out_dir: str) -> str:
    """Write ``DIGEST_FILE`` (``{"sha256", "dtype"}``) for ``model`` into a checkpoint dir."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    digest = weights_digest(model)
    with open(os.path.join(out_dir, DIGEST_FILE), "w") as fh:
        json.dump({"sha256": digest, "dtype": dtype}, fh)
    return digest


def read_digest(ckpt_dir: str) -> dict | None:
    """The ``DIGEST_FILE`` of a local checkpoint dir, or None (a copied model has none)."""
    try:
        with open(os.path.join(ckpt_dir, DIGEST_FILE)) as fh:
            rec = json.load(fh)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and "sha256" in rec else None


def stored_digest(store: Store, run_id: str, version: int) -> str | None:
    """The weights digest (``DIGEST_FILE``) of a committed version in the store, or None
    (a copied model: no digest was written with it)."""
    rel = f"{checkpoint_relpath(run_id, version)}/{DIGEST_FILE}"
    if not store.exists(rel):
        return None
    try:
        rec = json.loads(store.read_bytes(rel))
    except (OSError, ValueError):
        return None
    return rec.get("sha256") if isinstance(rec, dict) else None


def put_digest(store: Store, run_id: str, version: int, digest: str, dtype: str) -> None:
    """Record a committed version's weights digest in the store (for a version copied in
    without one, once it has been computed)."""
    body = json.dumps({"sha256": digest, "dtype": dtype}).encode()
    store.write_bytes(f"{checkpoint_relpath(run_id, version)}/{DIGEST_FILE}", body)
