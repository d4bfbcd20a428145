"""Durable TITO writer: a local write-ahead log (group-committed, fsynced) + Parquet segments.

``TitoLog.append(record)`` returns once the record is in the local WAL and fsynced: the
gateway calls it before it answers a harness, so an answer the harness saw is never missing
from storage. Records are moved to the store's ``tito`` dataset (one Parquet segment per batch,
``store.append``) by a background thread, by count (``flush_records``) or age
(``flush_seconds``), and on ``flush()`` / ``close()``.

WAL layout (``spool_dir``)::

    wal-{created_ns:020d}-{uuid8}.log     # frames: <u32 len><u32 crc32><payload>
    payload = <u32 header_len> header(json) new_input_ids(int32) output_ids(int32) logprobs(f32)

The active WAL is sealed (closed, a new one opened) when a batch is flushed; a sealed WAL is
deleted once its segment is in the store. On open, every WAL left behind (a crash, a stop
without flush) is replayed into the store: records whose ``request_id`` already sits in a store
segment written after the WAL was created are skipped, so a crash between "segment written" and
"WAL deleted" neither loses nor duplicates a record. A torn tail frame (crash mid-write, never
acknowledged) is dropped.

``fsync=False`` acknowledges a record once it is written to the WAL file (in the OS page cache):
it survives the gateway process being killed, not a machine crash before the next flush
(``flush_seconds``). Per-record fdatasync costs ~4 ms on a virtio disk; use it where the harness
can outlive the machine.

Concurrency: any number of threads may ``append``; one writer thread batches all pending frames
into one write + one fsync (group commit), so fsync cost is shared under load. Async callers use
``append_async`` (same durability, awaits the commit without blocking the event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from storage.schemas import TITO_SCHEMA
from storage.store import Store, StoreError
from storage.tito import TitoRecord

log = logging.getLogger(__name__)

_FRAME = struct.Struct("<II")  # payload length, crc32
_HLEN = struct.Struct("<I")
_SCALARS = [
    f.name for f in TITO_SCHEMA if f.name not in ("new_input_ids", "output_ids", "output_logprobs")
]


class TitoLogError(RuntimeError):
    """The TITO log is closed or its spool directory cannot be written."""


# -- frame encoding ------------------------------------------------------------------------


def encode_frame(rec: TitoRecord) -> bytes:
    """One WAL frame for a record (binary token arrays, JSON scalars)."""
    new = np.asarray(rec.new_input_ids, dtype=np.int32)
    out = np.asarray(rec.output_ids, dtype=np.int32)
    lps = np.asarray(rec.output_logprobs, dtype=np.float32)
    header = {k: getattr(rec, k) for k in _SCALARS}
    header["_n"] = [int(new.size), int(out.size), int(lps.size)]
    h = orjson.dumps(header)
    payload = b"".join((_HLEN.pack(len(h)), h, new.tobytes(), out.tobytes(), lps.tobytes()))
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def decode_payload(payload: bytes) -> TitoRecord:
    (hlen,) = _HLEN.unpack_from(payload, 0)
    header = orjson.loads(payload[4 : 4 + hlen])
    n_new, n_out, n_lp = header.pop("_n")
    off = 4 + hlen
    new = np.frombuffer(payload, dtype=np.int32, count=n_new, offset=off)
    off += 4 * n_new
    out = np.frombuffer(payload, dtype=np.int32, count=n_out, offset=off)
    off += 4 * n_out
    lps = np.frombuffer(payload, dtype=np.float32, count=n_lp, offset=off)
    return TitoRecord(new_input_ids=new, output_ids=out, output_logprobs=lps, **header)


def read_wal(path: str) -> list[TitoRecord]:
    """Every complete, checksummed record of a WAL file; a torn or corrupt tail is dropped."""
    with open(path, "rb") as fh:
        data = fh.read()
    recs: list[TitoRecord] = []
    pos = 0
    while pos + _FRAME.size <= len(data):
        n, crc = _FRAME.unpack_from(data, pos)
        start = pos + _FRAME.size
        payload = data[start : start + n]
        if len(payload) < n or zlib.crc32(payload) != crc:
            log.warning("tito wal %s: dropping torn tail at byte %d", path, pos)
            break
        recs.append(decode_payload(payload))
        pos = start + n
    return recs


def records_to_table(records: Sequence[TitoRecord]) -> pa.Table:
    """Columnar TITO table (no per-token Python objects: list columns from offsets + values)."""

    def list_col(seqs: list, np_type, pa_type) -> pa.Array:
        arrs = [np.asarray(s, dtype=np_type) for s in seqs]
        offsets = np.zeros(len(arrs) + 1, dtype=np.int32)
        np.cumsum([a.size for a in arrs], out=offsets[1:])
        values = np.concatenate(arrs) if arrs else np.zeros(0, dtype=np_type)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa_type))

    cols: dict[str, pa.Array] = {}
    for f in TITO_SCHEMA:
        if f.name == "new_input_ids":
            cols[f.name] = list_col([r.new_input_ids for r in records], np.int32, pa.int32())
        elif f.name == "output_ids":
            cols[f.name] = list_col([r.output_ids for r in records], np.int32, pa.int32())
        elif f.name == "output_logprobs":
            cols[f.name] = list_col([r.output_logprobs for r in records], np.float32, pa.float32())
        else:
            cols[f.name] = pa.array([getattr(r, f.name) for r in records], type=f.type)
    return pa.table(cols, schema=TITO_SCHEMA)


def table_to_records(table: pa.Table) -> list[TitoRecord]:
    return [TitoRecord.from_row(r) for r in table.to_pylist()]


# -- the log -------------------------------------------------------------------------------


class _Wal:
    """One WAL file plus the records it holds (kept in memory until flushed)."""

    def __init__(self, spool_dir: str):
        created = time.time_ns()
        self.created_ns = created
        self.path = os.path.join(spool_dir, f"wal-{created:020d}-{uuid.uuid4().hex[:8]}.log")
        self.fh = open(self.path, "ab", buffering=0)  # noqa: SIM115  (kept open for appends)
        self.records: list[TitoRecord] = []
        self.t_first = 0.0


class TitoLog:
    """Durable, thread-safe TITO writer into ``store``'s ``tito`` dataset (see module doc)."""

    def __init__(
        self,
        store: Store,
        spool_dir: str,
        *,
        flush_records: int = 512,
        flush_seconds: float = 2.0,
        fsync: bool = True,
    ):
        self.store = store
        self.fsync = bool(fsync)
        self.spool_dir = os.path.abspath(spool_dir)
        self.flush_records = int(flush_records)
        self.flush_seconds = float(flush_seconds)
        os.makedirs(self.spool_dir, exist_ok=True)
        self.replayed = self._replay()
        self._lock = threading.Lock()  # guards _pending, _writing, _closed
        self._cond = threading.Condition(self._lock)
        self._wal_lock = threading.Lock()  # guards _wal (the file being appended to)
        self._writing = 0
        self._closed_no_flush = False
        self._sealed: list[_Wal] = []  # sealed WALs not yet in the store
        self._pending: list[tuple[TitoRecord, bytes, Any]] = []
        self._wal = _Wal(self.spool_dir)
        self._closed = False
        self._flush_lock = threading.Lock()  # one store flush at a time
        self._flush_wanted = threading.Event()
        self.stats = {"appended": 0, "fsyncs": 0, "segments": 0, "flushed": 0}
        self._writer = threading.Thread(target=self._write_loop, name="tito-wal", daemon=True)
        self._flusher = threading.Thread(target=self._flush_loop, name="tito-flush", daemon=True)
        self._writer.start()
        self._flusher.start()

    # -- public API ----------------------------------------------------------------------
    def append(self, record: TitoRecord) -> None:
        """Return once ``record`` is written and fsynced in the local WAL."""
        done = threading.Event()
        box: list[BaseException] = []
        self._enqueue(record, ("thread", done, box))
        done.wait()
        if box:
            raise box[0]

    async def append_async(self, record: TitoRecord) -> None:
        """Like ``append``, awaiting the group commit instead of blocking the event loop."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._enqueue(record, ("async", loop, fut))
        await fut

    def flush(self) -> None:
        """Move every acknowledged record to the store now (blocks until written)."""
        with self._cond:  # let the writer commit what is queued first
            while self._pending or self._writing:
                self._cond.wait(0.05)
        self._flush_once()

    def close(self) -> None:
        """Flush and stop the background threads; further appends raise."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._writer.join()
        self._flush_wanted.set()
        self._flusher.join()
        self._flush_once()
        with self._wal_lock:
            self._wal.fh.close()
            if not self._wal.records:
                _unlink(self._wal.path)

    def abandon(self) -> None:
        """Stop without flushing to the store (as a crash would; the WAL stays for replay)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._closed_no_flush = True
        self._writer.join()
        self._flush_wanted.set()
        self._flusher.join()
        with self._wal_lock:
            self._wal.fh.close()

    def __enter__(self) -> TitoLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------
    def _enqueue(self, record: TitoRecord, waiter: Any) -> None:
        frame = encode_frame(record)
        if not self.fsync:  # one write syscall, inline: no thread hand-off to wait for
            self._write_now(record, frame)
            _wake(waiter, None)
            return
        with self._cond:
            if self._closed:
                raise TitoLogError("TitoLog is closed")
            self._pending.append((record, frame, waiter))
            self._cond.notify()

    def _write_now(self, record: TitoRecord, frame: bytes) -> None:
        if self._closed:
            raise TitoLogError("TitoLog is closed")
        with self._wal_lock:
            wal = self._wal
            try:
                wal.fh.write(frame)
            except OSError as exc:
                raise TitoLogError(f"TITO WAL write failed ({wal.path}): {exc}") from exc
            if not wal.records:
                wal.t_first = time.monotonic()
            wal.records.append(record)
            self.stats["appended"] += 1
            n_wal = len(wal.records)
        if n_wal >= self.flush_records:
            self._flush_wanted.set()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending and self._closed:
                    return
                batch, self._pending = self._pending, []
                self._writing = len(batch)
            # write + fsync outside the queue lock: enqueuers (the event loop) never wait on disk
            err: BaseException | None = None
            with self._wal_lock:
                wal = self._wal
                try:
                    wal.fh.write(b"".join(f for _, f, _ in batch))
                    if self.fsync:
                        os.fdatasync(wal.fh.fileno())
                    if not wal.records:
                        wal.t_first = time.monotonic()
                    wal.records.extend(r for r, _, _ in batch)
                    self.stats["appended"] += len(batch)
                    self.stats["fsyncs"] += 1
                except OSError as exc:  # disk full, spool removed...: every waiter hears it
                    err = TitoLogError(f"TITO WAL write failed ({wal.path}): {exc}")
                n_wal = len(wal.records)
            with self._cond:
                self._writing = 0
                self._cond.notify_all()
            for _, _, w in batch:
                _wake(w, err)
            if n_wal >= self.flush_records:
                self._flush_wanted.set()

    def _flush_loop(self) -> None:
        while True:
            self._flush_wanted.wait(timeout=max(0.05, self.flush_seconds / 4))
            self._flush_wanted.clear()
            if getattr(self, "_closed_no_flush", False):
                return
            with self._wal_lock:
                wal = self._wal
                due = wal.records and (
                    len(wal.records) >= self.flush_records
                    or time.monotonic() - wal.t_first >= self.flush_seconds
                )
            closed = self._closed
            if due:
                try:
                    self._flush_once()
                except StoreError as exc:  # an outage: its message says it all
                    log.error("tito: flush failed; records stay in the WAL: %s", exc)
                except Exception:  # the WAL still holds the records; retried next round
                    log.exception("tito: flush to %s failed; records stay in the WAL", self.store)
            if closed:
                return

    def _flush_once(self) -> None:
        with self._flush_lock:
            with self._wal_lock:
                if self._wal.records:
                    self._sealed.append(self._wal)
                    self._wal = _Wal(self.spool_dir)
            while self._sealed:  # oldest first; a failure leaves the rest for the next round
                sealed = self._sealed[0]
                sealed.fh.close()
                self.store.append("tito", records_to_table(sealed.records))
                _unlink(sealed.path)
                self._sealed.pop(0)
                self.stats["segments"] += 1
                self.stats["flushed"] += len(sealed.records)

    def _replay(self) -> int:
        """Move records of WALs left behind into the store, skipping ones already there."""
        wals = sorted(n for n in os.listdir(self.spool_dir) if n.startswith("wal-"))
        total = 0
        for name in wals:
            path = os.path.join(self.spool_dir, name)
            recs = read_wal(path)
            if recs:
                created_ns = int(name.split("-")[1])
                present = self._request_ids_since(created_ns - 5_000_000_000)
                todo = [r for r in recs if r.request_id not in present]
                if todo:
                    self.store.append("tito", records_to_table(todo))
                total += len(todo)
                log.info("tito: replayed %d/%d records from %s", len(todo), len(recs), name)
            _unlink(path)
        return total

    def _request_ids_since(self, t_ns: int) -> set[str]:
        """Request ids in store segments whose name says they were written at or after t_ns."""
        ids: set[str] = set()
        for seg in self.store.segments("tito"):
            try:
                seg_ns = int(seg.rsplit("/", 1)[-1].split("-")[1])
            except (IndexError, ValueError):
                seg_ns = t_ns
            if seg_ns < t_ns:
                continue
            table = self.store.read_segment(seg)  # through the store's retries
            if table is not None:  # None: undecodable, now quarantined
                ids.update(table.column("request_id").to_pylist())
        return ids


def _wake(waiter: Any, err: BaseException | None) -> None:
    kind = waiter[0]
    if kind == "thread":
        _, ev, box = waiter
        if err is not None:
            box.append(err)
        ev.set()
    else:
        _, loop, fut = waiter

        def _set() -> None:
            if fut.done():
                return
            if err is not None:
                fut.set_exception(err)
            else:
                fut.set_result(None)

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:  # inline write on the loop's own thread
            _set()
            return
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is waiting any more
            loop.call_soon_threadsafe(_set)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# -- bytes report (bench/tito.py) -----------------------------------------------------------


def tito_bytes_report(
    records: Iterable[TitoRecord], stored_bytes: int | None = None
) -> dict[str, float]:
    """Bytes stored for one session vs unique tokens x 4 bytes vs the naive full-context size.

    ``stored_bytes`` defaults to the size of one zstd Parquet segment holding exactly these
    records (what ``TitoLog`` writes per batch). ``naive`` stores every call's full input +
    output as int32. ``unique`` = sum of new input + output tokens (each token once).
    """
    from storage.tito import reconstruct_inputs, unique_tokens

    recs = list(records)
    if stored_bytes is None:
        sink = pa.BufferOutputStream()
        pq.write_table(records_to_table(recs), sink, compression="zstd")
        stored_bytes = sink.getvalue().size
    uniq = unique_tokens(recs)
    full = reconstruct_inputs(recs)
    flat = sum(len(full[r.request_id]) + len(r.output_ids) for r in recs)
    return {
        "records": len(recs),
        "unique_tokens": uniq,
        "flat_tokens": flat,
        "stored_bytes": int(stored_bytes),
        "unique_bytes": 4 * uniq,
        "naive_bytes": 4 * flat,
        "stored_over_unique": stored_bytes / max(1, 4 * uniq),
        "naive_over_unique": flat / max(1, uniq),
    }
