"""The executor's two ways of not waiting in series (infra/cells/executor.py): the parts
of one role change run beside each other (``together``), and ``cells`` rows are written by
a thread of their own, in order (infra/cells/cells_log.py). Plain threads and a real local
store; no cluster."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from infra.cells.cells_log import CellsLog
from infra.cells.executor import together
from storage.store import Store


def _row(i: int) -> dict:
    return {"run_id": "r", "cell_id": f"c{i % 3}", "event": "decide", "role": "rollout", "t": i}


def test_together_runs_the_parts_beside_each_other_and_waits_for_all():
    pool = ThreadPoolExecutor(4)
    ended: list[str] = []

    def part(name: str, s: float):
        def run():
            time.sleep(s)
            ended.append(name)
            return name

        return run

    t0 = time.monotonic()
    out = together(pool, part("main", 0.4), part("a", 0.4), part("b", 0.4))
    took = time.monotonic() - t0
    # three parts of 0.4 s: 0.4 s beside each other, 0.8 s with the main one first, 1.2 s
    # one after another
    assert out == "main" and sorted(ended) == ["a", "b", "main"]
    assert 0.4 <= took < 0.7, took


def test_together_raises_a_parts_error_only_once_every_part_ended():
    pool = ThreadPoolExecutor(4)
    done = threading.Event()

    def slow():
        time.sleep(0.3)
        done.set()

    def broken():
        raise RuntimeError("set_role failed")

    with pytest.raises(RuntimeError, match="set_role failed"):
        together(pool, slow, broken)
    assert done.is_set()
    done.clear()
    with pytest.raises(ValueError, match="drain"):  # the main part's own error, after the parts
        together(pool, lambda: (_ for _ in ()).throw(ValueError("drain")), slow)
    assert done.is_set()


def test_rows_are_written_in_order_in_few_segments_and_flush_waits_for_them(tmp_path):
    store = Store(str(tmp_path / "s"))
    errors: list[Exception] = []
    log = CellsLog(store, errors.append)
    for i in range(40):
        log.append(_row(i))
    assert log.flush(timeout=30)
    got = store.read("cells").to_pylist()
    assert [r["t"] for r in got] == list(range(40))  # every row, in the order made
    assert errors == []
    # batched: one append per batch the thread found waiting, far fewer than one per row
    segments = [p for p in store.fs.ls(store.path("cells")) if p.endswith(".parquet")]
    assert 1 <= len(segments) < 40
    assert log.close(timeout=30)
    with pytest.raises(RuntimeError, match="closed"):
        log.append(_row(99))


def test_a_failed_write_goes_to_the_callback_and_later_rows_still_land(tmp_path):
    class FailsOnce(Store):
        failed = False

        def append(self, dataset, rows):
            if not self.failed:
                self.failed = True
                raise OSError("the bucket said 503")
            return super().append(dataset, rows)

    store = FailsOnce(str(tmp_path / "s"))
    errors: list[Exception] = []
    log = CellsLog(store, errors.append)
    log.append(_row(0))
    assert log.flush(timeout=30)
    log.append(_row(1))
    assert log.close(timeout=30)
    assert [str(e) for e in errors] == ["the bucket said 503"]
    assert [r["t"] for r in store.read("cells").to_pylist()] == [1]
