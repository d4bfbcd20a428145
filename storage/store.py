"""The store: any fsspec URL holding append-only Parquet datasets and checkpoints.

Layout under the root URL::

    {dataset}/part-{time_ns}-{uuid}.parquet   # one immutable segment per append
    checkpoints/v{N}/...                       # storage/checkpoints.py

A segment is written under a temporary name and then moved into place (local
file systems) or put in one request (object stores), so readers never see a
half-written segment. The directory listing of ``{dataset}/`` is the manifest.
A local directory is the default (``./gyre-data``); ``s3://bucket/prefix`` goes
through s3fs, which honours the usual AWS variables (``AWS_ENDPOINT_URL`` for
MinIO or a moto server).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from storage.schemas import SCHEMAS

log = logging.getLogger(__name__)

_RETRIES = 3


class StoreError(RuntimeError):
    """A store URL cannot be used, or an object-store call kept failing."""


def _with_retries(what: str, fn, *args, **kwargs):
    """Retry an object-store call a bounded number of times (I/O boundary only)."""
    for attempt in range(1, _RETRIES + 1):
        try:
            return fn(*args, **kwargs)
        except (OSError, TimeoutError) as exc:
            if isinstance(exc, FileNotFoundError) or attempt == _RETRIES:
                raise
            log.warning("store: %s failed (attempt %d/%d): %s", what, attempt, _RETRIES, exc)
            time.sleep(0.2 * attempt)
    raise AssertionError("unreachable")


def s3_options_from_env() -> dict[str, Any]:
    opts: dict[str, Any] = {"use_listings_cache": False}
    endpoint = os.environ.get("GYRE_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        opts["endpoint_url"] = endpoint
    return opts


class Store:
    """Datasets and checkpoints under one fsspec URL."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        if not url:
            raise StoreError("empty store URL; pass a directory or s3://bucket/prefix")
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        if protocol == "file":
            path = url.split("://", 1)[1] if "://" in url else url
            self.root = os.path.abspath(os.path.expanduser(path))
            self.url = self.root
        else:
            self.root = url.split("://", 1)[1].rstrip("/")
            self.url = f"{protocol}://{self.root}"
        self.protocol = protocol
        opts = dict(storage_options or {})
        if protocol == "s3":
            opts = {**s3_options_from_env(), **opts}
        self.storage_options = opts
        try:
            self.fs = fsspec.filesystem(protocol, **opts)
        except (ImportError, ValueError) as exc:
            raise StoreError(f"cannot open store {url!r}: {exc}") from exc
        if protocol == "file":
            os.makedirs(self.root, exist_ok=True)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def __reduce__(self):  # ship by URL, reopen on the other side (Dask workers)
        return (Store, (self.url if self.protocol != "file" else self.root, self.storage_options))

    # -- paths -------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """A path inside the store, in the file system's own form (no protocol)."""
        return "/".join([self.root, *[p.strip("/") for p in parts if p]])

    def full_url(self, *parts: str) -> str:
        p = self.path(*parts)
        return p if self.protocol == "file" else f"{self.protocol}://{p}"

    # -- datasets ----------------------------------------------------------
    def append(self, dataset: str, rows: Sequence[dict[str, Any]] | pa.Table) -> str | None:
        """Write one immutable segment; returns its path (None when there is nothing to write)."""
        schema = SCHEMAS.get(dataset)
        if isinstance(rows, pa.Table):
            table = rows if schema is None else rows.select(schema.names).cast(schema)
        else:
            if not rows:
                return None
            if schema is None:
                table = pa.Table.from_pylist(list(rows))
            else:
                table = pa.Table.from_pylist(
                    [{k: r.get(k) for k in schema.names} for r in rows], schema=schema
                )
        if table.num_rows == 0:
            return None
        name = f"part-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet"
        final = self.path(dataset, name)
        if self.protocol == "file":
            os.makedirs(self.path(dataset), exist_ok=True)
            tmp = self.path(dataset, f".{name}.tmp")
            pq.write_table(table, tmp, compression="zstd")
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        else:
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink, compression="zstd")
            data = sink.getvalue().to_pybytes()
            _with_retries(f"put {final}", self.fs.pipe_file, final, data)
        return final

    def segments(self, dataset: str, since_ns: int | None = None) -> list[str]:
        """Segment paths in write order; ``since_ns`` keeps those written at or after it."""
        base = self.path(dataset)
        try:
            names = _with_retries(f"list {base}", self.fs.ls, base, detail=False)
        except FileNotFoundError:
            return []
        segs = sorted(n for n in names if n.rsplit("/", 1)[-1].startswith("part-"))
        if since_ns is not None:
            segs = [n for n in segs if int(n.rsplit("/", 1)[-1].split("-")[1]) >= since_ns]
        return segs

    def read(self, dataset: str, since_ns: int | None = None) -> pa.Table:
        """A dataset's segments as one table (empty, with the schema, if none).

        ``since_ns`` reads only segments written at or after that time (``time.time_ns()``
        of the writer), so a step reads what its own rollouts wrote, not the whole history.
        """
        segs = self.segments(dataset, since_ns)
        schema = SCHEMAS.get(dataset)
        if not segs:
            if schema is None:
                return pa.table({})
            return schema.empty_table()
        tables = []
        for s in segs:
            with _with_retries(f"open {s}", self.fs.open, s, "rb") as fh:
                tables.append(pq.read_table(fh))
        table = pa.concat_tables(tables, promote_options="default")
        return table if schema is None else table.select(schema.names).cast(schema)

    def dataset_bytes(self, dataset: str) -> int:
        return sum(int(self.fs.size(s)) for s in self.segments(dataset))

    # -- plain objects -----------------------------------------------------
    def exists(self, *parts: str) -> bool:
        return bool(_with_retries("exists", self.fs.exists, self.path(*parts)))

    def write_bytes(self, relpath: str, data: bytes) -> str:
        p = self.path(relpath)
        if self.protocol == "file":
            os.makedirs(os.path.dirname(p), exist_ok=True)
            tmp = p + f".{uuid.uuid4().hex[:6]}.tmp"
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, p)
        else:
            _with_retries(f"put {p}", self.fs.pipe_file, p, data)
        return p

    def read_bytes(self, relpath: str) -> bytes:
        return _with_retries(f"get {relpath}", self.fs.cat_file, self.path(relpath))

    def put_dir(self, local_dir: str, relpath: str) -> str:
        """Copy a local directory's files (flat) into the store."""
        for name in sorted(os.listdir(local_dir)):
            src = os.path.join(local_dir, name)
            if os.path.isfile(src):
                with open(src, "rb") as fh:
                    self.write_bytes(f"{relpath}/{name}", fh.read())
        return self.path(relpath)

    def get_dir(self, relpath: str, local_dir: str) -> str:
        """Copy a store directory's files (flat) to a local directory."""
        os.makedirs(local_dir, exist_ok=True)
        for p in _with_retries("list", self.fs.ls, self.path(relpath), detail=False):
            name = p.rstrip("/").rsplit("/", 1)[-1]
            data = _with_retries(f"get {p}", self.fs.cat_file, p)
            with open(os.path.join(local_dir, name), "wb") as fh:
                fh.write(data)
        return local_dir

    def listdir(self, relpath: str) -> list[str]:
        try:
            return sorted(
                p.rstrip("/").rsplit("/", 1)[-1]
                for p in self.fs.ls(self.path(relpath), detail=False)
            )
        except FileNotFoundError:
            return []
