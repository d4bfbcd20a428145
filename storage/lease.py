"""One writer per run: a lease in the store, held by the process that writes a run's data.

``gyre run`` (new or resumed) and ``gyre serve`` take the lease of their run
(``_leases/{run_id}.json`` in the store) before they touch the run's data, renew it while
they run (a heartbeat every ``ttl_s / 4``) and release it at the end. Anyone else asking
for the same store and run id is refused with `LeaseHeld`, which names the holder (host,
pid, command, since when) and what to do.

A holder that died without releasing (SIGKILL, a lost machine) does not block for ever:
its lease is free ``ttl_s`` after its last heartbeat, and on the holder's own host at once
when its process is gone.

Every change is a compare-and-swap on the lease file:

- local directory: read, decide and write under an exclusive ``flock`` of a lock file beside
  the lease (the kernel drops it when the process dies); the lease is written to a
  temporary name and renamed into place;
- S3: conditional writes: a new lease is put with ``If-None-Match: *``, a renewal, takeover
  or release with ``If-Match: <ETag read before deciding>``, so of two racing writers one
  gets 412 (AWS S3 since 2024-08, MinIO, moto; s3fs's ``mode="create"`` and ``IfMatch``);
- any other file system (``memory://``): read, decide, write, then read back the token
  (best effort: no atomic primitive there).

Pure module: no prefect, no distributed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator

from storage.paths import check_run_id
from storage.store import Store, StoreError

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 180.0  # past the store's retry bound (120 s), so an outage alone keeps it
_TRIES = 8  # compare-and-swap rounds before giving up on a contended lease
_S3 = ("s3", "s3a")  # s3fs: conditional writes


class LeaseHeld(RuntimeError):
    """Another live process holds the run's lease; the message names it and what to do."""

    def __init__(self, store_url: str, run_id: str, holder: dict):
        self.holder = holder
        now = time.time()
        host, pid = holder.get("host", "?"), holder.get("pid", "?")
        expires = float(holder.get("beat", now)) + float(holder.get("ttl_s", DEFAULT_TTL_S))
        super().__init__(
            f"run {run_id!r} in {store_url} is in use by {holder.get('what', 'a gyre process')} "
            f"(pid {pid} on {host}, since {_utc(holder.get('since'))}, last heartbeat "
            f"{max(0.0, now - float(holder.get('beat', now))):.0f}s ago; command: "
            f"{holder.get('command', '?')}). One process writes a run at a time: wait for it "
            f"to end, stop it (kill {pid} on {host}), or use another run id. If it died, its "
            f"lease is taken over at once on {host} and anywhere after {_utc(expires)}."
        )


class LeaseLost(RuntimeError):
    """A holder's lease was taken by another process (its heartbeats stopped for a TTL)."""


class _Conflict(Exception):
    """A conditional write lost to another writer (not an OSError: never retried)."""


def lease_relpath(run_id: str) -> str:
    return f"_leases/{check_run_id(run_id)}.json"


def _utc(t: object) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(t)))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "?"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _pid_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot; None if there is no such live
    process (gone, or a zombie nobody reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""  # alive, start time unknown (no /proc)
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else fields[19]


_HOST, _BOOT = socket.gethostname(), _boot_id()


def _holder_gone(rec: dict, now: float) -> bool:
    """Whether a lease record no longer stands: released, expired, or its process is gone
    (this host only: a pid means nothing elsewhere)."""
    if rec.get("released"):
        return True
    if now - float(rec.get("beat", 0)) > float(rec.get("ttl_s", DEFAULT_TTL_S)):
        return True
    if rec.get("host") == _HOST and rec.get("boot_id") == _BOOT:
        start = _pid_start(int(rec.get("pid", -1)))
        return start is None or bool(start and rec.get("pid_start") and start != rec["pid_start"])
    return False


# -- the lease file: read, and compare-and-swap write, per kind of store ------------------


class _File:
    """The lease file of one store: ``read() -> (record, tag)``; ``write(record, tag, create)``
    succeeds only if the file is still as read (raises `_Conflict` otherwise)."""

    def __init__(self, store: Store, rel: str):
        self.store, self.rel, self.path = store, rel, store.path(rel)

    def _call(self, what: str, fn, *args, **kwargs):
        def once():
            try:
                return fn(*args, **kwargs)
            except FileExistsError as exc:  # If-None-Match failed
                raise _Conflict(str(exc)) from exc
            except OSError as exc:  # If-Match failed: s3fs maps 412 to EINVAL
                if "pre-condition" in str(exc).lower() or "precondition" in str(exc).lower():
                    raise _Conflict(str(exc)) from exc
                raise

        # the store's own bounded retries: an outage the run's other calls waited out is not
        # waited out again here (the release of a run whose store went away took a second bound)
        return self.store._retry(f"{what} {self.path}", once)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        if self.store.protocol != "file":
            yield
            return
        import fcntl

        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # drops the flock

    def read(self) -> tuple[dict | None, str | None]:
        fs = self.store.fs
        tag = None
        try:
            if self.store.protocol in _S3:  # the ETag first: a newer body then fails If-Match
                tag = self._call("stat", fs.info, self.path).get("ETag")
            body = self._call("read", fs.cat_file, self.path)
        except FileNotFoundError:
            return None, None
        try:
            rec = json.loads(body)
        except ValueError:  # a torn file (should not happen: writes are whole)
            rec = {"token": None, "released": True}
        return (rec if isinstance(rec, dict) else {"token": None, "released": True}), tag

    def write(self, rec: dict, tag: str | None, *, create: bool) -> None:
        data = json.dumps(rec).encode()
        if self.store.protocol == "file":  # under the flock: no one else is deciding
            self.store.write_bytes(self.rel, data)
            return
        if self.store.protocol in _S3:
            cond = {"mode": "create"} if create else {"IfMatch": tag}
            self._call("put", self.store.fs.pipe_file, self.path, data, **cond)
            return
        self._call("put", self.store.fs.pipe_file, self.path, data)
        back, _ = self.read()  # no atomic primitive: the last writer's token stands
        if not back or back.get("token") != rec.get("token"):
            raise _Conflict("another writer's lease was read back")


# -- the lease -------------------------------------------------------------------------


class Lease:
    """The lease of one run in one store, for this process. ``acquire()`` or refuse with
    `LeaseHeld`; a daemon thread renews it; ``release()`` frees it. A context manager."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        what: str,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        on_lost: Callable[[], None] | None = None,
    ):
        self.store, self.run_id, self.what = store, run_id, what
        self.ttl_s = float(ttl_s)
        self.on_lost = on_lost
        self.token = uuid.uuid4().hex
        self.taken_over: dict | None = None  # the dead holder's record, when taken over
        self.lost = False
        self._file = _File(store, lease_relpath(run_id))
        self._since = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self, now: float, **extra) -> dict:
        return {
            "token": self.token,
            "what": self.what,
            "command": shlex.join(sys.argv)[:300],
            "host": _HOST,
            "boot_id": _BOOT,
            "pid": os.getpid(),
            "pid_start": _pid_start(os.getpid()) or "",
            "since": self._since or now,
            "beat": now,
            "ttl_s": self.ttl_s,
            **extra,
        }

    def acquire(self) -> Lease:
        prev: dict | None = None
        for _ in range(_TRIES):
            with self._file.locked():
                rec, tag = self._file.read()
                now = time.time()
                if rec is not None and rec.get("token") == self.token:
                    break  # an earlier try of ours landed (its answer was lost)
                if rec is not None and not _holder_gone(rec, now):
                    raise LeaseHeld(self.store.url, self.run_id, rec)
                prev, self._since = rec, now
                try:
                    self._file.write(self._record(now), tag, create=rec is None)
                    break
                except _Conflict:
                    continue  # someone else wrote first: look again
        else:
            rec, _ = self._file.read()
            raise LeaseHeld(self.store.url, self.run_id, rec or {})
        if prev is not None and not prev.get("released"):
            self.taken_over = prev
            log.warning(
                "lease of run %s: took over from %s (pid %s on %s), which is gone",
                self.run_id,
                prev.get("what"),
                prev.get("pid"),
                prev.get("host"),
            )
        self._thread = threading.Thread(
            target=self._beat, name=f"gyre-lease-{self.run_id}", daemon=True
        )
        self._thread.start()
        return self

    def renew(self) -> None:
        """One heartbeat; `LeaseLost` if another process holds the lease now."""
        with self._file.locked():
            rec, tag = self._file.read()
            if rec is None or rec.get("token") != self.token:
                raise LeaseLost(f"lease of run {self.run_id!r} lost to {rec}")
            try:
                self._file.write(self._record(time.time()), tag, create=False)
            except _Conflict as exc:
                raise LeaseLost(f"lease of run {self.run_id!r} lost: {exc}") from exc

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self.renew()
            except LeaseLost as exc:
                self.lost = True
                log.error("%s; another process may be writing this run", exc)
                if self.on_lost is not None:
                    self.on_lost()
                return
            except (StoreError, OSError) as exc:  # try again at the next beat
                log.warning("lease of run %s: heartbeat failed: %s", self.run_id, exc)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.lost:
            return
        try:
            with self._file.locked():
                rec, tag = self._file.read()
                if rec is not None and rec.get("token") == self.token:
                    now = time.time()
                    self._file.write(self._record(now, released=now), tag, create=False)
        except (_Conflict, StoreError, OSError) as exc:  # it expires on its own
            log.warning("lease of run %s: release failed: %s", self.run_id, exc)

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def holder(store: Store, run_id: str) -> dict | None:
    """The record of the live holder of a run's lease, None if it is free (a quick check
    before starting anything; `Lease.acquire` is the one that counts)."""
    rec, _ = _File(store, lease_relpath(run_id)).read()
    return None if rec is None or _holder_gone(rec, time.time()) else rec


def check_free(store: Store, run_id: str) -> None:
    """Raise `LeaseHeld` if a live process holds the run's lease."""
    rec = holder(store, run_id)
    if rec is not None:
        raise LeaseHeld(store.url, run_id, rec)
