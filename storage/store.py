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

Faults: every object-store call is retried with exponential backoff while the
error is transient (connection refused, timeouts, 5xx), for at most
``retry_s`` seconds, then fails with a `StoreError` that names the store and the
bound; a missing key, a missing bucket or refused credentials fail at once. A
segment that cannot be decoded is moved to ``_quarantine/{dataset}/`` (with a
note saying why), logged as an error and listed in ``Store.quarantined``; readers
then go on without it, so a bad file is reported, never silently skipped.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import random
import time
import uuid
from collections.abc import Sequence
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from storage.schemas import SCHEMAS

log = logging.getLogger(__name__)

DEFAULT_RETRY_S = 120.0  # how long a run waits out an object-store outage
RETRY_ENV = "GYRE_STORE_RETRY_S"  # sets that bound for a run and its cells (inherited)


# errors that say "this will not get better by waiting"
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
_PERMANENT_NAMES = ("Credential", "ParamValidation", "InvalidRegion", "NoRegion")


class StoreError(RuntimeError):
    """A store URL cannot be used, or an object-store call kept failing.

    ``outage``: the store at ``url`` was unreachable past the bound. Such an error
    carries that knowledge to the process that receives it (a cell's task failing in the
    flow's process): unpickling it records the outage there too, so that process's own
    calls to the store fail at once instead of waiting out a second bound.
    """

    def __init__(self, message: str, *, url: str | None = None, outage: bool = False):
        super().__init__(message)
        self.url, self.outage = url, outage

    def __reduce__(self):
        return (_store_error, (str(self), self.url, self.outage))


def _store_error(message: str, url: str | None, outage: bool) -> StoreError:
    if outage and url is not None:
        _OUTAGES.setdefault(url, time.monotonic())
    return StoreError(message, url=url, outage=outage)


# store URL -> when this process learnt that it is unreachable (see with_retries)
_OUTAGES: dict[str, float] = {}


def default_retry_s() -> float:
    """The outage bound: ``$GYRE_STORE_RETRY_S`` seconds, else `DEFAULT_RETRY_S`."""
    raw = os.environ.get(RETRY_ENV, "").strip()
    if not raw:
        return DEFAULT_RETRY_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < 86400:
        raise StoreError(f"{RETRY_ENV}={raw!r}: not a number of seconds in (0, 86400); unset it")
    return value


_BACKOFF_FIRST_S, _BACKOFF_MAX_S = 0.2, 5.0
QUARANTINE = "_quarantine"


def url_problem(url: str, *, shared: bool = False) -> str | None:
    """Why ``url`` cannot name a store, judged from the URL alone (no I/O), or None.

    ``shared``: the store must be reachable from other processes (a run's cells and
    engines), which a ``memory://`` store, living inside one process, is not.
    """
    if not url.strip():
        return "empty: give a directory or s3://bucket/prefix"
    protocol, _, rest = url.partition("://") if "://" in url else ("file", "", url)
    if protocol in ("s3", "s3a") and not rest.strip("/"):
        return f"{protocol}:// names no bucket: give s3://bucket or s3://bucket/prefix"
    if protocol in ("s3", "s3a") and rest.startswith("/"):
        return f"{protocol}:///... names no bucket (three slashes): give s3://bucket/prefix"
    if protocol == "memory" and shared:
        return (
            "a memory:// store lives inside one process, and a run's cells and engines are "
            "other processes that cannot see it: use a directory or s3://bucket/prefix"
        )
    return None


def _no_credentials(exc: BaseException) -> bool:
    return type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError")


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: OS-level I/O errors and the network errors of s3fs's clients
    (botocore/aiohttp), but not a missing object, refused access or bad credentials."""
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, OSError | TimeoutError):
        return True
    module = type(exc).__module__.split(".")[0]
    if module in ("botocore", "aiobotocore", "aiohttp", "urllib3"):
        return not any(n in type(exc).__name__ for n in _PERMANENT_NAMES)
    return False


S3_TRIES = 1  # s3fs's retry loop per call; with_retries retries on top, within retry_s


def with_retries(
    what: str, fn, *args, retry_s: float = DEFAULT_RETRY_S, outage_key: str | None = None, **kwargs
):
    """Call ``fn`` at an I/O boundary, retrying transient errors with exponential backoff
    (0.2 s doubling to 5 s, jittered) for at most ``retry_s`` seconds.

    ``outage_key`` (a store's URL) bounds an outage once per process, not once per call:
    a call that waits out the bound records the outage, and from then on, for one more
    bound, every call to that store, those already waiting included, fails at its next
    transient error instead of waiting again; a success clears it. So a run whose store
    goes away ends within about one bound with one error, however many calls were made.
    """
    deadline = time.monotonic() + retry_s
    delay, attempt = _BACKOFF_FIRST_S, 0
    while True:
        attempt += 1
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            if not is_transient(exc):
                raise
            now = time.monotonic()
            left = deadline - now
            down = _OUTAGES.get(outage_key) if outage_key is not None else None
            if down is not None and now - down >= retry_s:
                _OUTAGES.pop(outage_key, None)  # long ago: wait this one out again
                down = None
            if left <= 0 or down is not None:
                if outage_key is not None:
                    _OUTAGES.setdefault(outage_key, now)
                waited = (
                    f"kept failing for {retry_s:.0f}s ({attempt} attempts)"
                    if down is None
                    else f"failed: the store has been unreachable for {now - down:.0f}s "
                    "(the bound was waited out once already)"
                )
                raise StoreError(
                    f"store: {what} {waited}: {type(exc).__name__}: {exc}; check that the "
                    "store is reachable",
                    url=outage_key,
                    outage=True,
                ) from None  # the message says it all: one traceback, not four
            log.warning(
                "store: %s failed (attempt %d, retrying for %.0fs more): %s: %s",
                what,
                attempt,
                left,
                type(exc).__name__,
                exc,
            )
            time.sleep(min(delay * (0.5 + random.random()), left))
            delay = min(delay * 2, _BACKOFF_MAX_S)
        else:
            if outage_key is not None:
                _OUTAGES.pop(outage_key, None)
            return result


def s3_options_from_env() -> dict[str, Any]:
    opts: dict[str, Any] = {
        "use_listings_cache": False,
        # one try per call at the transport (botocore's own retries; s3fs's are set on the
        # file system, S3_TRIES): retries are with_retries' job, so that retry_s bounds a
        # failing call (one call took ~10 s against a stopped endpoint otherwise)
        "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}},
    }
    endpoint = os.environ.get("GYRE_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        opts["endpoint_url"] = endpoint
    return opts


class Store:
    """Datasets and checkpoints under one fsspec URL."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        create: bool = True,
        retry_s: float | None = None,
    ):
        """Open the store at ``url``. ``create=False`` refuses a store that does not exist
        (a missing directory or bucket) instead of making one: for readers such as
        ``gyre sql``. ``retry_s`` bounds how long transient object-store errors are retried
        (`default_retry_s` when None).
        """
        if (why := url_problem(url)) is not None:
            raise StoreError(why)
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        if protocol == "file":
            path = url.split("://", 1)[1] if "://" in url else url
            self.root = os.path.abspath(os.path.expanduser(path))
            self.url = self.root
        else:
            self.root = url.split("://", 1)[1].rstrip("/")
            self.url = f"{protocol}://{self.root}"
        self.protocol = protocol
        self.retry_s = float(retry_s) if retry_s is not None else default_retry_s()
        self.quarantined: list[str] = []
        opts = dict(storage_options or {})
        if protocol == "s3":
            opts = {**s3_options_from_env(), **opts}
        self.storage_options = opts
        try:
            self.fs = fsspec.filesystem(protocol, **opts)
            if protocol == "s3":
                self.fs.retries = S3_TRIES  # s3fs's own retry loop (a class default of 5)
        except (ImportError, ValueError) as exc:
            raise StoreError(f"cannot open store {url!r}: {exc}") from exc
        if protocol == "file" and os.path.exists(self.root) and not os.path.isdir(self.root):
            raise StoreError(
                f"{self.root} is a file, not a store directory; give a "
                "directory (a run creates it) or s3://bucket/prefix"
            )
        if not create:
            if not self.exists():
                raise StoreError(
                    f"no store at {self.url}: the {'directory' if protocol == 'file' else 'bucket or prefix'} "
                    "does not exist; check --store (a run creates it)"
                )
        elif protocol == "file":
            os.makedirs(self.root, exist_ok=True)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def __reduce__(self):  # ship by URL, reopen on the other side (Dask workers)
        url = self.url if self.protocol != "file" else self.root
        return (_reopen, (url, self.storage_options, self.retry_s))

    def _retry(self, what: str, fn, *args, **kwargs):
        try:
            return with_retries(
                what, fn, *args, retry_s=self.retry_s, outage_key=self.url, **kwargs
            )
        except Exception as exc:
            if _no_credentials(exc):
                raise StoreError(
                    f"no AWS credentials found for {self.url} ({what}: {exc}); set "
                    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or "
                    "~/.aws/credentials) for the bucket, or use a local directory as --store"
                ) from exc
            raise

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
            self._retry(f"put {final}", self.fs.pipe_file, final, data)
        return final

    def segments(self, dataset: str, since_ns: int | None = None) -> list[str]:
        """Segment paths in write order; ``since_ns`` keeps those written at or after it."""
        base = self.path(dataset)
        try:
            names = self._retry(f"list {base}", self.fs.ls, base, detail=False)
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
        tables = [t for t in (self.read_segment(s) for s in segs) if t is not None]
        if not tables:
            return pa.table({}) if schema is None else schema.empty_table()
        table = pa.concat_tables(tables, promote_options="default")
        if schema is None:
            return table
        for f in schema:  # a column added after these segments were written: null in them
            if f.name not in table.column_names:
                table = table.append_column(f, pa.nulls(table.num_rows, f.type))
        return table.select(schema.names).cast(schema)

    def own_segment(self, path: str) -> str | None:
        """``path`` as one of this store's own segments, or None.

        A segment is a ``part-*.parquet`` file directly under one of the store's dataset
        directories (``{root}/{dataset}/``). The path is normalised (``..``) and, on a
        local file system, its links are resolved, so a path that only *spells* a place
        in the store (``{root}/../x``, a link in a dataset directory pointing elsewhere)
        is not one. Returns the segment's path in the store's own form.
        """
        p = path.split("://", 1)[1] if "://" in path else path
        if self.protocol == "file":
            rel = os.path.relpath(os.path.realpath(p), os.path.realpath(self.root))
            parts = rel.split(os.sep)
        else:
            norm = posixpath.normpath("/" + p).strip("/")
            root = self.root.strip("/")
            if not norm.startswith(root + "/"):
                return None
            parts = norm[len(root) + 1 :].split("/")
        if len(parts) != 2:
            return None
        dataset, name = parts
        if dataset in ("", ".", "..", "checkpoints") or dataset[0] in "_.":
            return None
        if not (name.startswith("part-") and name.endswith(".parquet")):
            return None
        return self.path(dataset, name)

    def read_segment(self, path: str) -> pa.Table | None:
        """One of the store's own segments, decoded in full; a segment that cannot be
        decoded is quarantined (None). Anything but an own segment (`own_segment`) is
        refused with a `StoreError` before it is read."""
        seg = self.own_segment(path)
        if seg is None:
            raise StoreError(
                f"store: {path} is not a segment of {self.url} (a link or a path leading "
                "out of the store?); it is not read"
            )
        path = seg
        data = self._retry(f"get {path}", self.fs.cat_file, path)
        try:
            return pq.read_table(pa.BufferReader(data))
        except (pa.ArrowException, OSError) as exc:
            self.quarantine(path, f"{type(exc).__name__}: {exc}")
            return None

    def quarantine(self, path: str, why: str) -> str:
        """Move a bad segment out of its dataset into ``_quarantine/`` with a note.

        Only the store's own segments (`own_segment`) are ever moved: anything else,
        such as a path outside the store, is refused with a `StoreError`.
        """
        seg = self.own_segment(path)
        if seg is None:
            raise StoreError(
                f"store: {path} cannot be read ({why}) and is not a segment of {self.url}, "
                "so it is not quarantined; remove it from the store by hand"
            )
        path = seg
        rel = path[len(self.root) :].strip("/")
        dest = self.path(QUARANTINE, rel)
        note = json.dumps({"segment": path, "why": why, "t": time.time()})
        if self.protocol == "file":
            os.makedirs(os.path.dirname(dest), exist_ok=True)
        try:
            self._retry(f"quarantine {path}", self.fs.mv, path, dest)
        except FileNotFoundError:
            if self._retry(f"stat {path}", self.fs.exists, path):
                raise
            # another reader moved it first
        self._retry(f"note {dest}", self.fs.pipe_file, dest + ".why.json", note.encode())
        log.error("store: corrupt segment %s quarantined to %s (%s)", path, dest, why)
        self.quarantined.append(path)
        return dest

    def dataset_bytes(self, dataset: str) -> int:
        return sum(int(self.fs.size(s)) for s in self.segments(dataset))

    # -- plain objects -----------------------------------------------------
    def exists(self, *parts: str) -> bool:
        """Whether a path (or the store's root) exists. Unlike ``fs.exists``, an
        unreachable store raises instead of answering False."""
        path = self.path(*parts)
        try:
            self._retry(f"stat {path}", self.fs.info, path)
        except FileNotFoundError:
            return False
        return True

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
            self._retry(f"put {p}", self.fs.pipe_file, p, data)
        return p

    def read_bytes(self, relpath: str) -> bytes:
        return self._retry(f"get {relpath}", self.fs.cat_file, self.path(relpath))

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
        for p in self._retry(f"list {relpath}", self.fs.ls, self.path(relpath), detail=False):
            name = p.rstrip("/").rsplit("/", 1)[-1]
            data = self._retry(f"get {p}", self.fs.cat_file, p)
            with open(os.path.join(local_dir, name), "wb") as fh:
                fh.write(data)
        return local_dir

    def remove(self, relpath: str) -> bool:
        """Delete one object; False if it was not there."""
        p = self.path(relpath)
        try:
            self._retry(f"rm {p}", self.fs.rm_file, p)
        except FileNotFoundError:
            return False
        return True

    def listdir(self, relpath: str) -> list[str]:
        try:
            return sorted(
                p.rstrip("/").rsplit("/", 1)[-1]
                for p in self._retry(
                    f"list {relpath}", self.fs.ls, self.path(relpath), detail=False
                )
            )
        except FileNotFoundError:
            return []


def _reopen(url: str, storage_options: dict[str, Any], retry_s: float) -> Store:
    return Store(url, storage_options, retry_s=retry_s)
