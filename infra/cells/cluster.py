"""Cells on a Dask cluster: one worker process per cell, roles as worker resources.

A cell's role is carried by its Dask resources (``rollout`` or ``train``; none while
``draining`` or ``loading``), so a Prefect task annotated with
``dask.annotate(resources={"train": 1})`` lands on a training cell. Every cell also offers
``harness`` slots whatever its role: agent harnesses are black boxes that only talk HTTP to
the gateway, so where they run does not follow the roles (at scale they run in sandboxes
off the accelerators). Long-lived machinery that must outlive single tasks (the engine and
its HTTP server, parked while the cell trains; the trainer replica; the cell's membership
in the data-parallel group) lives in the ``CellPlugin`` of the worker process.

Control-plane calls (start an engine, load weights, change role) go through
``Client.run`` on one named worker; units of work (rollouts, processing,
training steps) are Prefect tasks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from distributed import Client, LocalCluster, WorkerPlugin, get_worker

log = logging.getLogger(__name__)

PLUGIN_NAME = "gyre-cell"
ROLES = ("rollout", "train", "draining", "loading", "idle")


class CellPlugin(WorkerPlugin):
    """Per-process state of a cell: its engine server and trainer replica."""

    name = PLUGIN_NAME

    def __init__(self) -> None:
        self.engine: Any = None
        self.server: Any = None
        self.trainer: Any = None
        self.trainer_key: tuple | None = None
        self.trainer_run: tuple | None = None  # (store, run id) the replica belongs to
        self.dp: Any = None  # this cell's DPGroup while it trains (tasks/train/dp.py)
        self.lock: threading.RLock | None = None  # made in setup: plugins are pickled

    def setup(self, worker) -> None:
        self.worker_address = worker.address
        self.lock = threading.RLock()

    def teardown(self, worker) -> None:
        self.stop_engine()
        if self.dp is not None:
            self.dp.close()
            self.dp = None

    def stop_engine(self) -> None:
        with self.lock or threading.RLock():
            if self.server is not None:
                try:
                    self.server.stop()
                finally:
                    self.server = None
            if self.engine is not None and hasattr(self.engine, "close"):
                self.engine.close()
            self.engine = None


def cell_name(worker_address: str) -> str:
    """A cell's id from its worker address: host and port, so that two hosts whose
    workers listen on the same port stay apart (``tcp://10.0.0.5:40123`` ->
    ``cell-10.0.0.5:40123``)."""
    return "cell-" + worker_address.split("://", 1)[-1]


def this_cell() -> CellPlugin:
    """The CellPlugin of the worker process running the caller (inside a Dask task)."""
    return get_worker().plugins[PLUGIN_NAME]


@dataclass
class Cells:
    """A running set of cells and the client that drives them."""

    client: Client
    cluster: LocalCluster | None
    roles: dict[str, str] = field(default_factory=dict)  # worker address -> role
    rollout_slots: float = 8.0  # Dask ``rollout`` resource of a rollout cell
    harness_slots: float = 8.0  # Dask ``harness`` resource of every cell

    @property
    def scheduler_address(self) -> str:
        return self.client.scheduler.address

    def cell_id(self, address: str) -> str:
        return cell_name(address)

    def with_role(self, role: str) -> list[str]:
        return sorted(a for a, r in self.roles.items() if r == role)

    def set_role(self, address: str, role: str) -> None:
        """Move a cell to a role (between tasks: switch first, then submit).

        ``draining`` and ``loading`` hold neither role's resource, so no new rollout or
        training work lands on a cell in transition; harness slots never change.
        """
        if role not in ROLES:
            raise ValueError(f"role {role!r}: use one of {ROLES}")
        resources = {
            "rollout": self.rollout_slots if role == "rollout" else 0.0,
            "train": 1.0 if role == "train" else 0.0,
            "harness": self.harness_slots,
        }
        self.client.run(_set_resources, resources, workers=[address], callback_timeout=60)
        self.roles[address] = role

    def run_on(self, address: str, fn, *args, **kwargs) -> Any:
        """Run ``fn(plugin, *args, **kwargs)`` on one cell, off the worker's event loop."""
        out = self.client.run(
            _call_on_plugin, fn, args, kwargs, workers=[address], callback_timeout=600
        )
        return out[address]

    def alive(self) -> set[str]:
        """Addresses of the cells the scheduler still knows (a dead cell drops out)."""
        return set(self.client.scheduler_info()["workers"]) & set(self.roles)


async def _set_resources(resources: dict[str, float], dask_worker=None) -> None:
    await dask_worker.set_resources(**resources)


async def _call_on_plugin(fn, args, kwargs, dask_worker=None):
    plugin = dask_worker.plugins[PLUGIN_NAME]
    return await asyncio.to_thread(fn, plugin, *args, **kwargs)


@contextmanager
def start_cells(
    n_cells: int,
    *,
    threads_per_cell: int = 2,
    memory_limit: str = "6GiB",
    scheduler_address: str | None = None,
    env: dict[str, str] | None = None,
    rollout_slots: int = 8,
    harness_slots: int = 8,
) -> Iterator[Cells]:
    """Start (or connect to) a Dask cluster whose workers are the cells.

    ``scheduler_address`` connects to an external ``dask scheduler``; its
    workers become the cells. Otherwise a LocalCluster of worker *processes*, each with
    ``threads_per_cell`` threads for work plus one per harness slot (harnesses mostly wait
    on HTTP and their environment).
    """
    cluster = None
    if scheduler_address:
        client = Client(scheduler_address, timeout="60s")
        client.wait_for_workers(n_cells, timeout=300)
    else:
        worker_env = {"OMP_NUM_THREADS": "1", **(env or {})}
        cluster = LocalCluster(
            n_workers=n_cells,
            threads_per_worker=threads_per_cell + harness_slots,
            processes=True,
            memory_limit=memory_limit,
            dashboard_address=":0",  # a free port: several runs may share a host
            host="127.0.0.1",
            worker_class="distributed.Nanny",
            env=worker_env,
        )
        client = Client(cluster)
    try:
        client.register_plugin(CellPlugin(), name=PLUGIN_NAME)
        addrs = sorted(client.scheduler_info()["workers"])[:n_cells]
        cells = Cells(
            client=client,
            cluster=cluster,
            roles={a: "idle" for a in addrs},
            rollout_slots=float(rollout_slots),
            harness_slots=float(harness_slots),
        )
        for a in addrs:
            cells.set_role(a, "idle")
        yield cells
    finally:
        t0 = time.monotonic()
        try:
            client.run(_stop_engine, callback_timeout=60)
        except Exception as exc:  # best effort: workers may already be gone
            log.warning("stopping engines: %s", exc)
        client.close()
        if cluster is not None:
            cluster.close()
        log.info("cells stopped in %.1fs", time.monotonic() - t0)


def _stop_engine(dask_worker=None) -> None:
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    if plugin is not None:
        plugin.stop_engine()
        if plugin.dp is not None:
            plugin.dp.close()
            plugin.dp = None


def default_worker_env() -> dict[str, str]:
    keep = (
        "GYRE_CACHE",
        "AWS_ENDPOINT_URL",
        "GYRE_S3_ENDPOINT_URL",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_DEFAULT_REGION",
        "HF_HUB_OFFLINE",
    )
    return {k: os.environ[k] for k in keep if k in os.environ}
