"""The lease (storage/lease.py) where generated mutants survived its other fast tests
(bench/mutation.py): the best-effort path of a store with no conditional writes
(``memory://``), which store errors count as a lost race, the released record, and what the
log says on a takeover, a lost lease and a failed release."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import uuid

import pytest

from storage import lease as lease_mod
from storage.lease import Lease, LeaseHeld, lease_relpath
from storage.store import Store


def _memory_store() -> Store:
    return Store(f"memory://gyre-mut-lease-{uuid.uuid4().hex}")


def test_a_store_without_conditional_writes_still_has_one_writer():
    store = _memory_store()
    a = Lease(store, "r1", "writer a").acquire()
    try:
        rec = json.loads(store.fs.cat_file(store.path(lease_relpath("r1"))))
        assert rec["token"] == a.token and rec["what"] == "writer a"
        with pytest.raises(LeaseHeld, match="writer a"):
            Lease(store, "r1", "writer b").acquire()
    finally:
        a.release()
    b = Lease(store, "r1", "writer b").acquire()  # released: free again
    b.release()


@pytest.mark.parametrize(
    "exc",
    [
        OSError(22, "Precondition Failed"),  # s3fs: a 412 to If-Match, as EINVAL
        OSError(22, "At least one of the pre-conditions you specified did not hold"),
        FileExistsError(17, "exists: _leases/r1.json"),  # If-None-Match failed
    ],
)
def test_a_failed_condition_is_a_lost_race_with_its_reason(tmp_path, exc):
    f = lease_mod._File(Store(str(tmp_path / "s"), retry_s=0), lease_relpath("r1"))

    def put():
        raise exc

    with pytest.raises(lease_mod._Conflict) as got:
        f._call("put", put)
    assert str(exc) in str(got.value)


def test_the_released_record_is_stamped_with_the_release_time(tmp_path):
    store = Store(str(tmp_path / "s"))
    t0 = time.time()
    Lease(store, "r1", "w").acquire().release()
    rec = json.loads(store.read_bytes(lease_relpath("r1")))
    assert t0 <= rec["released"] <= time.time()
    assert rec["beat"] == rec["released"]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_takeover_is_logged_naming_the_dead_holder(tmp_path, caplog):
    store = Store(str(tmp_path / "s"))
    pid = _dead_pid()
    dead = {
        "token": "old",
        "what": "old holder",
        "host": lease_mod._HOST,
        "boot_id": lease_mod._BOOT,
        "pid": pid,
        "pid_start": "1",
        "since": time.time(),
        "beat": time.time(),
        "ttl_s": 600.0,
    }
    store.write_bytes(lease_relpath("r1"), json.dumps(dead).encode())
    with caplog.at_level(logging.WARNING, logger=lease_mod.log.name):
        a = Lease(store, "r1", "new").acquire()
    a.release()
    assert a.taken_over["token"] == "old"
    want = f"lease of run r1: took over from old holder (pid {pid} on {lease_mod._HOST}), which is gone"
    assert want in caplog.messages


def test_a_lost_lease_is_logged_and_reported(tmp_path, caplog):
    store = Store(str(tmp_path / "s"))
    lost = []
    a = Lease(store, "r1", "w", ttl_s=0.2, on_lost=lambda: lost.append(1))
    with caplog.at_level(logging.ERROR, logger=lease_mod.log.name):
        a.acquire()
        rec = json.loads(store.read_bytes(lease_relpath("r1")))
        store.write_bytes(lease_relpath("r1"), json.dumps(rec | {"token": "thief"}).encode())
        deadline = time.monotonic() + 10
        while not lost and time.monotonic() < deadline:
            time.sleep(0.02)
        a.release()
    assert lost == [1] and a.lost
    assert any(m.endswith("; another process may be writing this run") for m in caplog.messages)
    assert any("lease of run 'r1' lost to" in m for m in caplog.messages)


def test_a_failed_release_is_logged_not_raised(tmp_path, caplog, monkeypatch):
    store = Store(str(tmp_path / "s"))
    a = Lease(store, "r1", "w").acquire()

    def broken(self, rec, tag, *, create):
        raise OSError("store gone")

    monkeypatch.setattr(lease_mod._File, "write", broken)
    with caplog.at_level(logging.WARNING, logger=lease_mod.log.name):
        a.release()
    assert "lease of run r1: release failed: store gone" in caplog.messages
