"""The ``cells`` rows of a run, written to the store off the caller's thread, in order.

Every decision and role change of the executor is a row of the ``cells`` dataset
(storage/schemas.py). One ``Store.append`` per row took ~46 ms on the shared 2-core host
(a Parquet segment written and renamed; an object PUT on a bucket), and the scheduling
loop made several per tick (a decision, one row per member of a step, a load per rollout
cell after each step): the loop, and every role change, waited for the store between
the cells' own work. Here rows are queued in the order they are made and one thread
appends what has queued since its last write as one segment (order kept: a row is
written after every row made before it). ``flush`` waits until every row queued so far
is in the store; ``close`` flushes and stops the thread.

A failed append is handed to ``on_error`` (the executor turns it into the error its loop
raises, as a failed append in the loop itself did) and the rows of that write are lost;
later rows are still written.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from storage.store import Store

log = logging.getLogger(__name__)


class CellsLog:
    """Ordered, batched, background appends of ``cells`` rows (see the module doc)."""

    def __init__(self, store: Store, on_error: Callable[[Exception], None], dataset="cells"):
        self.store, self.on_error, self.dataset = store, on_error, dataset
        self._rows: list[dict[str, Any]] = []
        self._made = 0  # rows appended to the log so far
        self._written = 0  # rows whose write has ended (written, or failed)
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gyre-cells-log", daemon=True)
        self._thread.start()

    def append(self, row: dict[str, Any]) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("the cells log is closed")
            self._rows.append(row)
            self._made += 1
            self._cv.notify_all()

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait (up to ``timeout``) until every row appended so far is written; whether it
        was."""
        with self._cv:
            want = self._made
            return self._cv.wait_for(lambda: self._written >= want, timeout=timeout)

    def close(self, timeout: float = 60.0) -> bool:
        """Flush, then stop the writer thread; whether everything was written in time."""
        done = self.flush(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=max(1.0, timeout))
        return done

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._rows or self._closed)
                if not self._rows:
                    return  # closed, nothing left
                rows, self._rows = self._rows, []
            try:
                self.store.append(self.dataset, rows)
            except Exception as exc:  # the store is failing: the caller decides what it means
                log.warning("%d %s row(s) not written: %s", len(rows), self.dataset, exc)
                try:
                    self.on_error(exc)
                except Exception:  # pragma: no cover - a broken callback must not kill the log
                    log.exception("the cells log's error callback failed")
            finally:
                with self._cv:
                    self._written += len(rows)
                    self._cv.notify_all()
