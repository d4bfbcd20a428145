"""One writer per run (storage/lease.py): of concurrent acquirers exactly one wins, on a
local directory and on S3 (moto); the refusal names the holder; a lease is kept alive by
its heartbeat, expires without one, and a dead holder on this host is taken over at once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from storage.lease import Lease, LeaseHeld, check_free, holder, lease_relpath
from storage.paths import RunIdError
from storage.store import Store
from tests.s3 import moto_s3


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path, free_port):
    if request.param == "file":
        yield Store(str(tmp_path / "store"))
        return
    with moto_s3(free_port(), ("leases",)):
        yield Store("s3://leases/store", retry_s=5)


def _race(store: Store, n: int) -> tuple[list[Lease], list[LeaseHeld]]:
    """``n`` threads acquire the same run's lease at once (separate open files: the flock
    is per open file description, so threads contend as processes would)."""
    barrier = threading.Barrier(n)
    won, refused, lock = [], [], threading.Lock()

    def one(i: int) -> None:
        lease = Lease(store, "r1", f"acquirer {i}")
        barrier.wait()
        try:
            lease.acquire()
            with lock:
                won.append(lease)
        except LeaseHeld as exc:
            with lock:
                refused.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return won, refused


def test_concurrent_acquirers_exactly_one_wins(store):
    for _ in range(3):
        won, refused = _race(store, 6)
        assert len(won) == 1 and len(refused) == 5
        w = won[0]
        for exc in refused:  # the refusal names the holder and what to do
            msg = str(exc)
            assert w.what in msg and f"pid {os.getpid()}" in msg
            assert socket.gethostname() in msg and "since" in msg and "UTC" in msg
            assert "another run id" in msg and exc.holder["token"] == w.token
        assert holder(store, "r1")["token"] == w.token
        with pytest.raises(LeaseHeld):
            check_free(store, "r1")
        w.release()
        assert holder(store, "r1") is None  # released: free at once
        check_free(store, "r1")


def test_heartbeat_keeps_it_and_expiry_frees_it(store):
    a = Lease(store, "r2", "a", ttl_s=0.6).acquire()
    time.sleep(1.5)  # over two TTLs: only the heartbeat keeps it
    with pytest.raises(LeaseHeld):
        Lease(store, "r2", "b").acquire()
    a._stop.set()  # heartbeats stop (a hung holder), the process lives on
    a._thread.join()
    time.sleep(0.8)
    b = Lease(store, "r2", "b").acquire()  # expired: taken over
    assert b.taken_over is not None and b.taken_over["token"] == a.token
    with pytest.raises(Exception, match="lost"):
        a.renew()  # the old holder learns it lost the lease
    b.release()


def test_foreign_holder_waits_for_its_ttl(store):
    """A holder on another host: its pid means nothing here, only its heartbeat counts."""
    now = time.time()
    rec = {"token": "x", "what": "gyre serve (port 1)", "command": "gyre serve", "host": "elsewhere",
           "boot_id": "b", "pid": 1, "since": now - 100, "beat": now - 5, "ttl_s": 60.0}  # fmt: skip
    store.write_bytes(lease_relpath("r3"), json.dumps(rec).encode())
    with pytest.raises(LeaseHeld, match=r"pid 1 on elsewhere.*gyre serve \(port 1\)|gyre serve"):
        Lease(store, "r3", "me").acquire()
    store.write_bytes(lease_relpath("r3"), json.dumps({**rec, "beat": now - 61}).encode())
    Lease(store, "r3", "me").acquire().release()


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from storage.lease import Lease
    from storage.store import Store
    Lease(Store(sys.argv[1]), "r4", "child", ttl_s=600).acquire()
    print("held", flush=True)
    time.sleep(600)
    """
)


def test_sigkilled_holder_on_this_host_is_taken_over_at_once(tmp_path):
    st = Store(str(tmp_path / "store"))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, st.url], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(LeaseHeld, match=f"pid {child.pid} on"):
            Lease(st, "r4", "me").acquire()
        os.kill(child.pid, signal.SIGKILL)
        # not reaped (a zombie holds no lease either); TTL 600 s: taken over as the pid is gone
        deadline = time.monotonic() + 10
        while True:
            try:
                me = Lease(st, "r4", "me").acquire()
                break
            except LeaseHeld:
                assert time.monotonic() < deadline, "a dead holder still blocks"
                time.sleep(0.05)
        assert me.taken_over["pid"] == child.pid
        me.release()
    finally:
        child.kill()
        child.wait()


def test_run_ids_are_checked():
    for bad in ("../x", "a/b", "..", ".hidden", "", "x" * 101, "a..b"):
        with pytest.raises(RunIdError):
            lease_relpath(bad)
