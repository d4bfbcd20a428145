"""Object-store faults: transient errors are waited out for a bounded time, permanent ones
fail at once, a stopped S3 endpoint (a real moto server) is survived when it comes back
and reported clearly when it does not, and a corrupt segment is quarantined and reported."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from storage.sql import query
from storage.store import Store, StoreError, is_transient, with_retries
from tests.s3 import moto_s3


def _rows(n: int, tag: str = "c"):
    return [
        {"run_id": "r", "cell_id": f"{tag}{i}", "event": "join", "role": "rollout", "t": 1.0}
        for i in range(n)
    ]


def test_transient_or_not():
    assert is_transient(ConnectionRefusedError()) and is_transient(TimeoutError())
    assert is_transient(OSError(5, "I/O error"))
    for permanent in (FileNotFoundError(), PermissionError(), IsADirectoryError(), KeyError()):
        assert not is_transient(permanent)


def test_retries_are_bounded_in_time_and_skip_permanent_errors():
    calls = []

    def flaky():
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise ConnectionResetError("reset")
        return "ok"

    assert with_retries("flaky", flaky, retry_s=10) == "ok" and len(calls) == 3

    def down():
        raise ConnectionRefusedError("refused")

    t0 = time.monotonic()
    with pytest.raises(StoreError, match=r"kept failing for 1s .*reachable"):
        with_retries("put x", down, retry_s=1.0)
    assert 0.9 <= time.monotonic() - t0 < 3.0

    missing = []

    def gone():
        missing.append(1)
        raise FileNotFoundError("no such key")

    with pytest.raises(FileNotFoundError):
        with_retries("get y", gone, retry_s=10)
    assert missing == [1]  # not retried


def test_a_reader_refuses_a_missing_store_and_creates_nothing(tmp_path):
    with pytest.raises(StoreError, match="no store at"):
        Store(str(tmp_path / "nope"), create=False)
    assert not (tmp_path / "nope").exists()
    Store(str(tmp_path / "made"))  # a writer creates it
    assert Store(str(tmp_path / "made"), create=False).exists()


def test_corrupt_segment_is_quarantined_and_reported(tmp_path, caplog):
    st = Store(str(tmp_path / "s"))
    st.append("cells", _rows(2, "a"))
    bad = st.append("cells", _rows(3, "b"))
    data = Path(bad).read_bytes()
    Path(bad).write_bytes(data[: len(data) // 2])  # a torn write from some other tool

    # SQL notices, quarantines, answers from the rest
    assert query(st, "SELECT count(*) AS n FROM cells").to_pylist() == [{"n": 2}]
    assert st.quarantined == [bad]
    assert "quarantined" in caplog.text
    moved = tmp_path / "s" / "_quarantine" / "cells" / bad.rsplit("/", 1)[-1]
    assert moved.exists() and moved.with_name(moved.name + ".why.json").exists()
    assert st.read("cells").num_rows == 2  # and it stays out of every later read

    # the reader path does the same for a segment corrupted later
    bad2 = st.append("cells", _rows(1, "c"))
    Path(bad2).write_bytes(b"not parquet at all")
    fresh = Store(str(tmp_path / "s"))
    assert fresh.read("cells").num_rows == 2 and fresh.quarantined == [bad2]


@pytest.mark.fault
@pytest.mark.integration
def test_s3_outage_is_waited_out_or_reported(free_port):
    with moto_s3(free_port(), buckets=("bkt",)) as server:
        st = Store("s3://bkt/run", retry_s=30)
        st.append("cells", _rows(1))
        with pytest.raises(StoreError, match="no store at"):
            Store("s3://no-such-bucket/x", create=False)

        server.stop()
        # the endpoint comes back 2 s later: the append in flight waits and succeeds
        back: list[float] = []

        def restart() -> None:
            server.start()
            back.append(time.monotonic())

        threading.Timer(2.0, restart).start()
        t0 = time.monotonic()
        seg = st.append("cells", _rows(2, "d"))
        # it returned only once the endpoint was back (s3fs's own retries or ours waited)
        assert back and time.monotonic() >= back[0] and time.monotonic() - t0 < 25
        assert seg and st.read("cells").num_rows == 3
        assert st.exists()

        # down for longer than the bound: a clear error, in bounded time, nothing half-written
        server.stop()
        short = Store("s3://bkt/run", retry_s=2)
        t0 = time.monotonic()
        with pytest.raises(StoreError, match=r"kept failing .*reachable"):
            short.append("cells", _rows(5, "e"))
        with pytest.raises(StoreError):
            short.exists()  # unreachable is not "missing"
        assert time.monotonic() - t0 < 20
        server.start()
        assert Store("s3://bkt/run").read("cells").num_rows == 3


@pytest.mark.fault
@pytest.mark.integration
def test_an_outage_is_waited_out_once_per_process_with_one_clear_error(free_port, tmp_path):
    """A run whose S3 store went away took two bounds and 33 tracebacks to end: every call
    after the first waited out the bound again, each error chained four tracebacks, and
    the flow's process waited again after its cells had. Now one bound, one error."""
    import pickle
    import subprocess
    import sys
    import traceback

    bound = 4.0
    with moto_s3(free_port(), buckets=("bkt",)) as server:
        st = Store("s3://bkt/out", retry_s=bound)
        st.append("cells", _rows(1))
        patient = Store("s3://bkt/out", retry_s=60)  # another call to it, with a long bound
        server.stop()

        t0 = time.monotonic()
        ended: dict[str, float] = {}

        def waiting() -> None:
            with pytest.raises(StoreError, match="unreachable"):
                patient.exists()
            ended["patient"] = time.monotonic() - t0

        th = threading.Thread(target=waiting)
        th.start()
        with pytest.raises(StoreError, match=r"kept failing for 4s") as first:
            st.append("cells", _rows(2, "d"))
        assert bound - 0.5 <= time.monotonic() - t0 < bound + 3

        # every later call fails at once, saying why, instead of waiting out a second bound
        # (made right away: an outage recorded more than one bound ago is waited out again,
        # and the waiting call below may sleep its backoff for up to 7.5 s before it ends)
        for call in (lambda: st.read("cells"), lambda: Store("s3://bkt/out").exists()):
            t1 = time.monotonic()
            with pytest.raises(StoreError, match=r"unreachable for .*check that the store"):
                call()
            assert time.monotonic() - t1 < 2.0

        th.join(timeout=30)
        # the call already waiting gave up once the bound was waited out, not after its own
        assert ended["patient"] < bound + 8

        # one traceback per error: the message carries the cause
        assert "".join(traceback.format_exception(first.value)).count("Traceback") == 1

        # another process (a cell) that waited out the bound tells this one with its error
        child = (
            "import pickle, sys\n"
            "from storage.store import Store, StoreError\n"
            "try:\n"
            "    Store('s3://bkt/other', retry_s=2).exists()\n"
            "except StoreError as exc:\n"
            "    sys.stdout.buffer.write(pickle.dumps(exc))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", child], capture_output=True, timeout=60, check=True
        ).stdout
        err = pickle.loads(out)
        assert isinstance(err, StoreError) and err.outage
        t1 = time.monotonic()
        with pytest.raises(StoreError, match="unreachable"):
            Store("s3://bkt/other", retry_s=60).exists()
        assert time.monotonic() - t1 < 2.0

        # back: the first call that works clears it
        server.start()
        assert st.read("cells").num_rows == 1
        assert Store("s3://bkt/other", retry_s=60).exists() is False
