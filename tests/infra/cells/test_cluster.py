"""Cells and the Dask machinery under them (infra/cells/cluster.py).

- No statistical profiler in the cells: on CPython 3.11 < 3.11.9 its
  ``sys._current_frames()`` can deadlock a process whose threads come and go (one per
  agent session), which froze a run's train step (``stop_thread_profiler``).
- The cells' workers are listed from the scheduler, not the client's cache (which a
  refresh leaves without workers): read from the cache, every cell of a run looked lost
  when another run started on the host (``worker_addrs``).
"""

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


def test_cells_are_listed_from_the_scheduler_not_the_clients_cache():
    """The client's cached identity lists no workers once its periodic refresh ran, and
    stays stale when a refresh fails: read from it, every cell looked lost at once."""
    from distributed.client import SchedulerInfo

    with start_cells(2, threads_per_cell=1, harness_slots=1) as cells:
        client = cells.client
        expected = set(cells.roles)

        async def refresh_fails(n_workers=0):  # what a refresh under load may do
            return None

        client._update_scheduler_info = refresh_fails
        client._scheduler_identity = SchedulerInfo({"workers": {}})
        assert cells.workers() == expected
        assert cells.alive() == expected
