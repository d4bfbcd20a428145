"""The lease (storage/lease.py) where generated mutants survived its other fast tests
(bench/mutation.py): the best-effort path of a store with no conditional writes
(``memory://``), which store errors count as a lost race, the released record, what the
log says on a takeover, a lost lease and a failed release; the refusal's whole message;
when a holder no longer stands (TTL boundary, this host and boot, a reused pid); the start
time read from /proc; the record's fields; acquire's tries, creates and re-entry; the
heartbeat's interval and errors; release of a lost or foreign lease; and the conditions
sent to S3 (moto)."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import socket
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


# -- the refusal's whole message -----------------------------------------------------------


def test_the_refusal_names_every_field_of_the_holder(monkeypatch):
    monkeypatch.setattr(lease_mod.time, "time", lambda: 1000.0)
    rec = {"host": "h1", "pid": 42, "what": "gyre run (demo)", "since": 0, "beat": 963,
           "ttl_s": 100, "command": "gyre run --preset demo"}  # fmt: skip
    exc = LeaseHeld("/s", "r1", rec)
    assert exc.holder is rec
    assert str(exc) == (
        "run 'r1' in /s is in use by gyre run (demo) (pid 42 on h1, since 1970-01-01 00:00:00"
        " UTC, last heartbeat 37s ago; command: gyre run --preset demo). One process writes a"
        " run at a time: wait for it to end, stop it (kill 42 on h1), or use another run id."
        " If it died, its lease is taken over at once on h1 and anywhere after 1970-01-01"
        " 00:17:43 UTC."  # the last beat (963 s) + its TTL (100 s)
    )


def test_the_refusal_of_a_holder_with_no_fields_says_so(monkeypatch):
    monkeypatch.setattr(lease_mod.time, "time", lambda: 1000.0)
    assert str(LeaseHeld("s3://b/p", "r2", {})) == (
        "run 'r2' in s3://b/p is in use by a gyre process (pid ? on ?, since ?, last heartbeat"
        " 0s ago; command: ?). One process writes a run at a time: wait for it to end, stop it"
        " (kill ? on ?), or use another run id. If it died, its lease is taken over at once on"
        " ? and anywhere after 1970-01-01 00:19:40 UTC."  # now (1000 s) + the default TTL (180 s)
    )


def test_a_heartbeat_from_a_clock_ahead_reads_as_0s_ago(monkeypatch):
    monkeypatch.setattr(lease_mod.time, "time", lambda: 1000.0)
    assert "last heartbeat 0s ago" in str(LeaseHeld("/s", "r", {"beat": 1010.0}))


def test_utc_formats_seconds_and_refuses_what_is_not_a_time():
    assert lease_mod._utc(0) == "1970-01-01 00:00:00 UTC"
    assert lease_mod._utc("86461.9") == "1970-01-02 00:01:01 UTC"
    assert lease_mod._utc(None) == "?" and lease_mod._utc("soon") == "?"


# -- when a holder no longer stands ---------------------------------------------------------


def _elsewhere(**rec) -> dict:
    return {"host": "another-host", "boot_id": "b", "pid": 1, **rec}


def test_a_holder_stands_until_its_ttl_has_passed_since_its_beat():
    gone = lease_mod._holder_gone
    assert not gone(_elsewhere(beat=100.0, ttl_s=50.0), 150.0)  # exactly its TTL: stands
    assert gone(_elsewhere(beat=100.0, ttl_s=50.0), 150.01)
    assert gone(_elsewhere(beat=1e9, ttl_s=50.0, released=1.0), 1e9)  # released: at once
    assert not gone(_elsewhere(beat=1e9, ttl_s=50.0, released=0), 1e9)


def test_a_record_without_beat_or_ttl_counts_from_0_with_the_default_ttl():
    gone, ttl = lease_mod._holder_gone, lease_mod.DEFAULT_TTL_S
    assert ttl == 180.0
    assert not gone(_elsewhere(), ttl - 0.5)
    assert gone(_elsewhere(), ttl + 0.5)
    assert not gone(_elsewhere(beat=0.0), ttl)  # the default TTL, not a shorter one
    assert gone(_elsewhere(ttl_s=10.0), 10.5)  # no beat: from 0


def _here(pid: int, **rec) -> dict:
    now = time.time()
    return {"host": lease_mod._HOST, "boot_id": lease_mod._BOOT, "pid": pid, "beat": now,
            "ttl_s": 600.0, **rec}  # fmt: skip


def test_a_dead_pid_frees_the_lease_only_on_this_host_since_this_boot():
    gone, dead = lease_mod._holder_gone, _dead_pid()
    now = time.time()
    assert gone(_here(dead), now)
    assert not gone(_here(dead, boot_id="an earlier boot"), now)  # a pid of another boot
    assert not gone(_here(dead, host="another-host"), now)  # a pid of another host
    assert not gone(_here(os.getpid()), now)  # alive, start time not recorded


def test_a_pid_reused_by_another_process_frees_the_lease():
    gone, now = lease_mod._holder_gone, time.time()
    mine = lease_mod._pid_start(os.getpid())
    assert mine  # this process, on Linux
    assert not gone(_here(os.getpid(), pid_start=mine), now)
    assert gone(_here(os.getpid(), pid_start=str(int(mine) + 1)), now)  # another start: reused
    assert not gone(_here(os.getpid(), pid_start=""), now)  # not recorded: no verdict


def test_a_record_on_this_host_without_a_pid_waits_for_its_ttl():
    rec = _here(0, pid_start="12345")
    del rec["pid"]  # no process to look at, whatever its recorded start: its TTL decides
    assert not lease_mod._holder_gone(rec, time.time())


# -- a process's start time, and the boot ---------------------------------------------------


def _fake_open(monkeypatch, text: str | None):
    def opener(path, *a, **k):
        if text is None:
            raise FileNotFoundError(path)
        return io.StringIO(text)

    monkeypatch.setattr(lease_mod, "open", opener, raising=False)


def _stat(comm: str, state: str) -> str:
    # proc(5): pid (comm) state, then fields 4..52; field n holds n here: starttime is 22
    return f"4242 ({comm}) {state} " + " ".join(str(n) for n in range(4, 53)) + "\n"


def test_pid_start_is_field_22_of_proc_stat_after_the_last_paren(monkeypatch):
    _fake_open(monkeypatch, _stat("a) b (c", "S"))
    assert lease_mod._pid_start(4242) == "22"
    _fake_open(monkeypatch, _stat("plain", "R"))
    assert lease_mod._pid_start(4242) == "22"


@pytest.mark.parametrize("state", ["Z", "X"])
def test_a_zombie_or_dead_process_has_no_start(monkeypatch, state):
    _fake_open(monkeypatch, _stat("x", state))
    assert lease_mod._pid_start(4242) is None


def test_pid_start_matches_the_kernel_for_this_process():
    with open(f"/proc/{os.getpid()}/stat") as fh:
        text = fh.read()
    want = text[text.rindex(")") + 1 :].split()[22 - 3]  # fields from 3 (state) on
    assert lease_mod._pid_start(os.getpid()) == want


def test_without_proc_a_live_pid_has_an_unknown_start_and_a_dead_one_none(monkeypatch):
    _fake_open(monkeypatch, None)
    sent, kill = [], os.kill
    monkeypatch.setattr(lease_mod.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    assert lease_mod._pid_start(4242) == "" and sent == [(4242, 0)]  # signal 0: a look only
    monkeypatch.setattr(lease_mod.os, "kill", kill)
    assert lease_mod._pid_start(os.getpid()) == ""
    assert lease_mod._pid_start(_dead_pid()) is None

    def denied(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(lease_mod.os, "kill", denied)
    assert lease_mod._pid_start(1) == ""  # another user's process: alive


def test_boot_id_is_the_kernels_and_empty_without_it(monkeypatch):
    with open("/proc/sys/kernel/random/boot_id") as fh:
        want = fh.read().strip()
    assert lease_mod._boot_id() == want == lease_mod._BOOT
    _fake_open(monkeypatch, None)
    assert lease_mod._boot_id() == ""


# -- the record, acquire, renew, the heartbeat and release ----------------------------------


def test_the_record_names_this_process_and_keeps_its_since(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["gyre", "run", "--note", "x" * 400])
    store = Store(str(tmp_path / "s"))
    a = Lease(store, "r1", "gyre run", ttl_s=600).acquire()
    try:
        rec = json.loads(store.read_bytes(lease_relpath("r1")))
        assert rec["command"] == ("gyre run --note " + "x" * 400)[:300]
        assert len(rec["command"]) == 300
        assert rec["token"] == a.token and rec["what"] == "gyre run" and rec["ttl_s"] == 600.0
        assert rec["host"] == socket.gethostname() and rec["boot_id"] == lease_mod._boot_id()
        assert rec["pid"] == os.getpid()
        assert rec["pid_start"] == lease_mod._pid_start(os.getpid())
        assert rec["since"] == rec["beat"] and "released" not in rec
        time.sleep(0.05)
        a.renew()
        again = json.loads(store.read_bytes(lease_relpath("r1")))
        assert again["since"] == rec["since"] and again["beat"] > rec["beat"]
    finally:
        a.release()


def test_an_unknown_start_time_is_recorded_as_empty(tmp_path, monkeypatch):
    monkeypatch.setattr(lease_mod, "_pid_start", lambda pid: None)
    rec = Lease(Store(str(tmp_path / "s")), "r1", "w")._record(5.0)
    assert rec["pid_start"] == "" and rec["since"] == 5.0 and rec["beat"] == 5.0


def test_a_lease_whose_earlier_try_landed_is_ours_without_a_takeover(tmp_path):
    store = Store(str(tmp_path / "s"))
    a = Lease(store, "r1", "w")
    ours = _elsewhere(token=a.token, beat=time.time(), ttl_s=600.0)  # live, and ours
    store.write_bytes(lease_relpath("r1"), json.dumps(ours).encode())
    assert a.acquire() is a
    try:
        assert a.taken_over is None and a._thread.is_alive()  # renewed from now on
    finally:
        a.release()


def test_writes_create_only_a_missing_lease(tmp_path, monkeypatch):
    store = Store(str(tmp_path / "s"))
    creates, write = [], lease_mod._File.write

    def spy(self, rec, tag, *, create):
        creates.append(create)
        return write(self, rec, tag, create=create)

    monkeypatch.setattr(lease_mod._File, "write", spy)
    a = Lease(store, "r1", "w").acquire()
    assert a.taken_over is None
    a.renew()
    a.release()
    b = Lease(store, "r1", "w").acquire()  # over a released record: no takeover
    assert b.taken_over is None
    b.release()
    assert creates == [True, False, False, False, False]


def test_the_heartbeat_thread_is_a_named_daemon(tmp_path):
    a = Lease(Store(str(tmp_path / "s")), "r7", "w").acquire()
    try:
        assert a._thread.name == "gyre-lease-r7" and a._thread.daemon and a._thread.is_alive()
    finally:
        a.release()
    assert a._thread is None


def test_a_lease_contended_past_its_tries_is_refused_naming_the_store(tmp_path, monkeypatch):
    store = Store(str(tmp_path / "s"))
    tries = []

    def conflict(self, rec, tag, *, create):
        tries.append(1)
        raise lease_mod._Conflict("lost")

    monkeypatch.setattr(lease_mod._File, "write", conflict)
    with pytest.raises(LeaseHeld) as got:
        Lease(store, "r1", "w").acquire()
    assert len(tries) == lease_mod._TRIES == 8
    assert str(got.value).startswith(f"run 'r1' in {store.url} is in use by a gyre process")
    assert got.value.holder == {}
    store.write_bytes(lease_relpath("r1"), json.dumps(_elsewhere(what="x", released=1)).encode())
    with pytest.raises(LeaseHeld, match="in use by x"):  # the record read last is named
        Lease(store, "r1", "w").acquire()


@pytest.mark.parametrize("body", [b'{"token": "tor', b"[1, 2]", b'"a string"'])
def test_a_torn_or_foreign_lease_file_counts_as_released(tmp_path, body):
    store = Store(str(tmp_path / "s"))
    store.write_bytes(lease_relpath("r1"), body)
    f = lease_mod._File(store, lease_relpath("r1"))
    assert f.read() == ({"token": None, "released": True}, None)
    a = Lease(store, "r1", "w").acquire()
    assert a.taken_over is None
    a.release()


def test_a_renewal_of_a_missing_or_foreign_lease_is_lost(tmp_path):
    store = Store(str(tmp_path / "s"))
    a = Lease(store, "r1", "w")
    with pytest.raises(lease_mod.LeaseLost, match="lease of run 'r1' lost to None"):
        a.renew()
    store.write_bytes(lease_relpath("r1"), json.dumps({"token": "other"}).encode())
    with pytest.raises(lease_mod.LeaseLost, match=re.escape("lost to {'token': 'other'}")):
        a.renew()


def test_a_renewal_that_loses_the_write_is_lost_with_the_reason(tmp_path, monkeypatch):
    store = Store(str(tmp_path / "s"))
    a = Lease(store, "r1", "w", ttl_s=600).acquire()
    a._stop.set()
    a._thread.join()

    def conflict(self, rec, tag, *, create):
        raise lease_mod._Conflict("412 from the store")

    monkeypatch.setattr(lease_mod._File, "write", conflict)
    with pytest.raises(lease_mod.LeaseLost, match="lease of run 'r1' lost: 412 from the store"):
        a.renew()


class _Beats:
    """A stand-in for the heartbeat's stop event: records the waits, stops after ``n``."""

    def __init__(self, n: int):
        self.n, self.waits = n, []

    def wait(self, timeout):
        self.waits.append(timeout)
        return len(self.waits) > self.n

    def set(self):
        pass


def test_the_heartbeat_renews_every_quarter_ttl_and_outlasts_store_errors(tmp_path, caplog):
    a = Lease(Store(str(tmp_path / "s")), "r1", "w", ttl_s=8.0)
    a._stop = _Beats(3)
    renewals = []

    def renew():
        renewals.append(1)
        if len(renewals) == 1:
            raise lease_mod.StoreError("store down")
        if len(renewals) == 2:
            raise OSError("connection reset")

    a.renew = renew
    with caplog.at_level(logging.WARNING, logger=lease_mod.log.name):
        a._beat()
    assert a._stop.waits == [2.0] * 4 and len(renewals) == 3 and not a.lost
    assert caplog.messages[:2] == [
        "lease of run r1: heartbeat failed: store down",
        "lease of run r1: heartbeat failed: connection reset",
    ]


def test_the_heartbeat_stops_at_a_lost_lease(tmp_path):
    lost = []
    a = Lease(Store(str(tmp_path / "s")), "r1", "w", ttl_s=4.0, on_lost=lambda: lost.append(1))
    a._stop = _Beats(10)
    renewals = []

    def renew():
        renewals.append(1)
        raise lease_mod.LeaseLost("taken")

    a.renew = renew
    a._beat()
    assert renewals == [1] and lost == [1] and a.lost and a._stop.waits == [1.0]
    b = Lease(Store(str(tmp_path / "s")), "r1", "w", ttl_s=4.0)  # no on_lost: no call
    b._stop, b.renew = _Beats(10), renew
    b._beat()
    assert b.lost


def test_release_leaves_a_lease_it_lost_or_never_held(tmp_path):
    store = Store(str(tmp_path / "s"))
    a = Lease(store, "r1", "w", ttl_s=600).acquire()
    thief = json.loads(store.read_bytes(lease_relpath("r1"))) | {"token": "thief"}
    store.write_bytes(lease_relpath("r1"), json.dumps(thief).encode())
    a.release()  # the token differs: the thief's record stays as it is
    assert json.loads(store.read_bytes(lease_relpath("r1"))) == thief
    b = Lease(store, "r1", "w")
    b.release()  # never acquired: nothing to join, nothing written
    assert json.loads(store.read_bytes(lease_relpath("r1"))) == thief
    c = Lease(store, "r2", "w", ttl_s=600).acquire()
    c.lost = True  # its heartbeat found it taken: release writes nothing
    before = store.read_bytes(lease_relpath("r2"))
    c.release()
    assert store.read_bytes(lease_relpath("r2")) == before and c._thread is None


def test_check_free_passes_a_free_or_released_run_and_names_a_held_one(tmp_path):
    store = Store(str(tmp_path / "s"))
    lease_mod.check_free(store, "r1")
    a = Lease(store, "r1", "the holder").acquire()
    want = f"run 'r1' in {store.url} is in use by the holder"
    with pytest.raises(LeaseHeld, match="^" + re.escape(want)) as got:
        lease_mod.check_free(store, "r1")
    assert got.value.holder["token"] == a.token
    with pytest.raises(LeaseHeld, match="^" + re.escape(want)):  # and so does acquire
        Lease(store, "r1", "w").acquire()
    a.release()
    lease_mod.check_free(store, "r1")


def test_a_best_effort_store_refuses_a_lease_another_writer_overwrote(monkeypatch):
    """memory://: the write lands, then another writer's lands over it before the read-back:
    that writer holds the lease, this one is refused."""
    store = _memory_store()
    other = _elsewhere(token="other", what="writer b", beat=time.time(), ttl_s=600.0)
    put = store.fs.pipe_file

    def racing(path, data, **kw):
        put(path, data, **kw)
        put(path, json.dumps(other).encode())

    monkeypatch.setattr(store.fs, "pipe_file", racing)
    with pytest.raises(LeaseHeld, match="in use by writer b"):
        Lease(store, "r1", "writer a").acquire()


def test_a_local_lease_is_decided_under_a_lock_beside_it(tmp_path):
    store = Store(str(tmp_path / "s"))
    Lease(store, "r1", "w").acquire().release()
    assert os.path.exists(store.path(lease_relpath("r1")) + ".lock")
    mem = _memory_store()
    Lease(mem, "r1", "w").acquire().release()
    assert not mem.fs.exists(mem.path(lease_relpath("r1")) + ".lock")


# -- S3: the conditions really sent --------------------------------------------------------


def test_s3_writes_are_conditional_on_absence_or_the_etag_read(free_port, monkeypatch):
    from tests.s3 import moto_s3

    bucket = f"leases-{uuid.uuid4().hex[:12]}"  # moto's buckets outlive its server
    with moto_s3(free_port(), (bucket,)):
        store = Store(f"s3://{bucket}/store", retry_s=5)
        sent, put = [], store.fs.pipe_file

        def spy(path, data, **kw):
            sent.append(kw)
            return put(path, data, **kw)

        monkeypatch.setattr(store.fs, "pipe_file", spy)
        a = Lease(store, "r1", "w", ttl_s=600).acquire()
        a._stop.set()
        a._thread.join()
        assert sent == [{"mode": "create"}]
        etag = store.fs.info(store.path(lease_relpath("r1")))["ETag"]
        assert etag
        f = lease_mod._File(store, lease_relpath("r1"))
        assert f.read()[1] == etag
        a.renew()
        assert sent[1] == {"IfMatch": etag}
        rec, tag = f.read()
        assert tag != etag and rec["token"] == a.token
        with pytest.raises(lease_mod._Conflict):  # the store refuses a stale tag
            f.write(rec, etag, create=False)
        with pytest.raises(lease_mod._Conflict):  # and a create over an existing lease
            f.write(rec, None, create=True)
        a.release()


def test_a_best_effort_store_renews_and_releases_its_own_lease():
    store = _memory_store()
    path = store.path(lease_relpath("r1"))
    a = Lease(store, "r1", "w", ttl_s=600).acquire()
    a._stop.set()
    a._thread.join()
    beat = json.loads(store.fs.cat_file(path))["beat"]
    time.sleep(0.01)
    a.renew()  # its own token read back: no conflict
    assert json.loads(store.fs.cat_file(path))["beat"] > beat
    a.release()
    assert json.loads(store.fs.cat_file(path))["released"]


def test_a_best_effort_renewal_overwritten_in_flight_is_lost_saying_so(monkeypatch):
    store = _memory_store()
    a = Lease(store, "r1", "w", ttl_s=600).acquire()
    a._stop.set()
    a._thread.join()
    put = store.fs.pipe_file

    def racing(path, data, **kw):
        put(path, data, **kw)
        put(path, json.dumps({"token": "other"}).encode())

    monkeypatch.setattr(store.fs, "pipe_file", racing)
    with pytest.raises(
        lease_mod.LeaseLost, match=r"^lease of run 'r1' lost: another writer's lease was read back$"
    ):
        a.renew()


def test_a_local_lease_is_replaced_whole_never_written_in_place(tmp_path, monkeypatch):
    """A local lease file is written to a temporary name and renamed (Store.write_bytes), so
    a reader never sees half a record; fsspec's pipe_file would write it in place."""
    store = Store(str(tmp_path / "s"))

    opened = store.fs.open

    def in_place(path, mode="rb", **k):
        assert "r" in mode, f"a local lease written in place ({mode})"
        return opened(path, mode, **k)

    monkeypatch.setattr(store.fs, "pipe_file", in_place)
    monkeypatch.setattr(store.fs, "open", in_place)
    a = Lease(store, "r1", "w", ttl_s=600).acquire()
    a.renew()
    a.release()
    assert json.loads(store.read_bytes(lease_relpath("r1")))["released"]


class _Reset(ConnectionResetError):
    pass


def _failing(calls: list):
    def fn(*a, **k):
        calls.append(1)
        raise _Reset(104, "Connection reset by peer")

    return fn


@pytest.mark.parametrize("verb", ["read", "put"])
def test_a_store_outage_names_the_lease_call_that_failed(monkeypatch, verb):
    store = _memory_store()
    store.retry_s = 0.0  # fail at the first transient error
    path = store.path(lease_relpath("r1"))
    if verb == "put":
        store.fs.pipe_file(path, json.dumps({"token": None, "released": True}).encode())
    calls = []
    monkeypatch.setattr(store.fs, "cat_file" if verb == "read" else "pipe_file", _failing(calls))
    with pytest.raises(lease_mod.StoreError) as got:
        Lease(store, "r1", "w").acquire()
    assert str(got.value).startswith(f"store: {verb} {path} kept failing for 0s (1 attempts)")
    assert calls == [1]


@pytest.mark.parametrize("verb", ["stat", "put"])
def test_an_s3_outage_names_the_lease_call_that_failed(free_port, monkeypatch, verb):
    from tests.s3 import moto_s3

    bucket = f"leases-{uuid.uuid4().hex[:12]}"
    with moto_s3(free_port(), (bucket,)):
        store = Store(f"s3://{bucket}/store", retry_s=0)
        path = store.path(lease_relpath("r1"))
        if verb == "stat":  # the ETag is looked up first
            store.fs.pipe_file(path, b"{}")
        monkeypatch.setattr(store.fs, "info" if verb == "stat" else "pipe_file", _failing([]))
        with pytest.raises(lease_mod.StoreError, match="^" + re.escape(f"store: {verb} {path} ")):
            Lease(store, "r1", "w").acquire()
