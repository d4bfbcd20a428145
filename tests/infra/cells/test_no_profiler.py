"""Cells run without Dask's statistical profiler: on CPython 3.11 < 3.11.9 its
``sys._current_frames()`` can deadlock a process whose threads come and go (one per agent
session), which froze a run's train step (infra/cells/cluster.py: stop_thread_profiler)."""

from __future__ import annotations

import pytest

from infra.cells.cluster import start_cells

pytestmark = pytest.mark.integration


def _callbacks(dask_worker) -> list[str]:
    return sorted(dask_worker.periodic_callbacks)


def test_cells_have_no_thread_profiler():
    with start_cells(1, threads_per_cell=1, harness_slots=1) as cells:
        seen = cells.client.run(_callbacks)
        assert seen and all("profile" not in cbs for cbs in seen.values()), seen
