"""`gyre session new` never deletes a live server's record (issue 26 §2).

A server busy for longer than the 3 s health probe (a big request, a slow machine) was taken
for dead and its record deleted: no session could be minted on it afterwards. A record is
removed only when its server is provably gone: its process is not alive, nothing listens on
its port, or its run's lease (`storage.lease`) is free or someone else's. Each case here is a
real process, socket and lease: the "server" is this test process holding the run's lease and
a socket that accepts connections but never answers (what a gateway whose event loop is
blocked looks like from outside).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from flows.serve import ServeError, live_records, new_session
from storage.lease import Lease
from storage.store import Store


@pytest.fixture()
def records(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "cache" / "serve"
    d.mkdir(parents=True)
    return d


def _record(records, port: int, store: str, pid: int) -> os.PathLike:
    path = records / f"{port}.json"
    rec = {
        "url": f"http://127.0.0.1:{port}",
        "admin_token": "t",
        "store": store,
        "run_id": "serve",
        "pid": pid,
        "port": port,
        "host": socket.gethostname(),
    }
    path.write_text(json.dumps(rec))
    return path


def _silent_socket() -> socket.socket:
    """Listens (the kernel completes connections) but never accepts, so never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


def test_a_silent_server_holding_its_lease_keeps_its_record(tmp_path, records):
    store = Store(str(tmp_path / "store"))
    sock = _silent_socket()
    port = sock.getsockname()[1]
    path = _record(records, port, store.url, os.getpid())
    lease = Lease(store, "serve", f"gyre serve (port {port})").acquire()
    try:
        t0 = time.monotonic()
        with pytest.raises(ServeError) as err:
            new_session(None, None, None)
        assert "did not answer /health" in str(err.value) and str(os.getpid()) in str(err.value)
        assert path.exists()  # today: deleted, and no session could be minted on it again
        assert time.monotonic() - t0 < 10
    finally:
        lease.release()
    # its lease released (the server stopped, or its record is older than its process):
    # the lease's word that it is gone, so the record goes
    assert live_records() == []
    assert not path.exists()
    sock.close()


def test_records_of_gone_servers_are_removed_at_once(tmp_path, records):
    store = str(tmp_path / "store")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    gone_pid = _record(records, 1, store, int(dead.stdout))
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    refused = _record(records, free.getsockname()[1], store, os.getpid())  # nothing listens
    free.close()
    t0 = time.monotonic()
    assert live_records() == []
    assert time.monotonic() - t0 < 2  # neither waited for the health probe's timeout
    assert not gone_pid.exists() and not refused.exists()


def test_a_silent_server_whose_run_another_process_holds_is_gone(tmp_path, records):
    """Its process is alive (or its pid is someone else's now) and something listens on its
    port, but the run's lease names another process: the lease's word is that it is gone."""
    store = Store(str(tmp_path / "store"))
    sock = _silent_socket()
    port = sock.getsockname()[1]
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path = _record(records, port, store.url, other.pid)
        lease = Lease(store, "serve", "gyre run").acquire()  # held by this test process
        try:
            assert live_records() == []
            assert not path.exists()
        finally:
            lease.release()
    finally:
        other.kill()
        other.wait()
        sock.close()
