"""A child process for tests/faults/test_step_commit.py: one real training step on one
member (``train_on_samples``: ledger check, trainer, commit), SIGKILLed at a chosen write.

    python -m tests.faults.commit_child STORE RUN_ID SEGMENT KILL_AT

``KILL_AT``: ``commit`` (before the marker that commits the step), ``ledger`` or ``steps``
(before that dataset's rows are appended), or ``none``. The kill is a real SIGKILL of this
process at that point, so nothing after it runs: no ``finally``, no flush.
"""

from __future__ import annotations

import os
import signal
import sys

from storage.store import Store
from tasks.train.config import TrainConfig
from tasks.train_step import train_on_samples


class KillingStore(Store):
    """The real store, except that the process kills itself before one chosen write."""

    def __init__(self, url: str, kill_at: str):
        super().__init__(url)
        self.kill_at = kill_at

    def _die(self) -> None:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def write_bytes(self, relpath: str, data: bytes) -> str:
        if self.kill_at == "commit" and relpath.endswith("/COMPLETE"):
            self._die()
        return super().write_bytes(relpath, data)

    def append(self, dataset, rows):
        if self.kill_at == dataset:
            self._die()
        return super().append(dataset, rows)


def main(url: str, run_id: str, segment: str, kill_at: str) -> None:
    store = KillingStore(url, kill_at)
    out = train_on_samples(store, run_id, 0, segment, TrainConfig(lr=1e-3), cell_id="child")
    print(f"committed v{out.weight_version}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
