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
import atexit
import importlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import dask
from distributed import Client, LocalCluster, WorkerPlugin, get_worker

log = logging.getLogger(__name__)

PLUGIN_NAME = "gyre-cell"
ROLES = ("rollout", "train", "draining", "loading", "idle")
CLOSE_TIMEOUT_S = 60.0  # how long cells get to stop their engines and leave
LOST_CLOSE_TIMEOUT_S = 5.0  # a client whose scheduler is gone has nothing to wait for
WORKERS_WAIT_S = 60.0  # how long a run waits for an external scheduler's workers to join


class CellLost(RuntimeError):
    """The worker process of a cell is gone (killed, crashed, its node lost)."""


class SchedulerLost(RuntimeError):
    """The run's Dask scheduler is gone (killed, crashed, its host lost): its cells and
    their work went with it."""


def reach_scheduler(address: str, timeout: float) -> None:
    """Open and close a TCP connection to a scheduler's address; raises OSError if none
    answers (a refused or timed-out connection)."""
    hostport = address.split("://", 1)[1]
    host, _, port = hostport.rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
        pass


def _scheduler_gone(address: str) -> bool:
    try:
        reach_scheduler(address, timeout=5.0)
    except OSError:
        return True
    return False


class TooFewWorkers(RuntimeError):
    """An external Dask scheduler has fewer workers than the run has cells."""


def wait_for_cells(client: Client, n_cells: int, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for ``n_cells`` workers (one per cell) on the
    scheduler; raise `TooFewWorkers` naming how many there are, how many are needed and
    the fix (Dask's own ``wait_for_workers`` ends in a bare TimeoutError)."""
    deadline = time.monotonic() + timeout
    while (have := len(worker_addrs(client))) < n_cells:
        if time.monotonic() >= deadline:
            address = client.scheduler.address
            raise TooFewWorkers(
                f"the Dask scheduler at {address} has {have} worker(s) after {timeout:.0f} s; "
                f"this run needs {n_cells}, one per cell (cluster.rollout_cells + "
                f"cluster.train_cells): start {n_cells - have} more (`dask worker {address}`) "
                "or lower cluster.rollout_cells / cluster.train_cells"
            )
        time.sleep(0.25)


def worker_addrs(client: Client) -> set[str]:
    """The workers the scheduler knows, asked of it now (see ``Cells.workers``)."""
    info = client.sync(client.scheduler.identity, n_workers=-1)
    return set(info["workers"])


def stop_thread_profiler(worker) -> None:
    """Stop the worker's statistical profiler (``distributed.worker.profile``).

    It samples every thread with ``sys._current_frames()`` every 10 ms. On CPython 3.11
    before 3.11.9 that call can deadlock the whole process against a thread that is
    exiting (python/cpython#106883, dask/distributed#8616): every thread then waits for the
    GIL forever. Cells start and end a thread per agent session, so a run hit it within
    minutes (a train step frozen inside torch, 0% CPU). The profile only feeds the
    dashboard's profile page; the rest of the dashboard is unaffected.
    """
    for name in ("profile", "profile-cycle"):
        pc = worker.periodic_callbacks.pop(name, None)
        if pc is not None:
            pc.stop()


class _TaskCompleted(logging.Filter):
    """Drops Prefect's "Finished in state Completed()" line of each task run: in a run it
    was about half of all log lines (every rollout, process and train task), and the
    progress line and the task runs' states say the same. Failed, crashed and cancelled
    tasks still log their end."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Finished in state Completed()"


def quiet_completed_tasks() -> None:
    """Install `_TaskCompleted` on Prefect's task-run logger in this process (once)."""
    logger = logging.getLogger("prefect.task_runs")
    if not any(isinstance(f, _TaskCompleted) for f in logger.filters):
        logger.addFilter(_TaskCompleted())


class CellPlugin(WorkerPlugin):
    """Per-process state of a cell: its engine server and trainer replica."""

    name = PLUGIN_NAME

    def __init__(self, token: str | None = None, preload: tuple[str, ...] = ()) -> None:
        # the run's token: a cell's engine bound beyond loopback requires it (it travels to
        # restarted workers with the plugin, through the scheduler, as the roles do)
        self.token = token
        self.preload = tuple(preload)  # modules imported in the background at setup
        self.worker_address = ""
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
        stop_thread_profiler(worker)
        torch_threads_from_env()
        if self.preload:  # the engine's and the tasks' imports, while the run sets up
            threading.Thread(
                target=_preload, args=(self.preload,), name="gyre-preload", daemon=True
            ).start()
        quiet_completed_tasks()  # this cell runs the run's tasks: their log lines
        if threading.current_thread() is threading.main_thread():
            # Ctrl-C in a terminal reaches the whole process group: the run's process stops
            # the cells in order; a cell must not die on its own first (its nanny would
            # restart it mid-shutdown)
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def teardown(self, worker) -> None:
        # the DP group is not destroyed here: a step still running when the worker is asked
        # to close (a run stopped by Ctrl-C) finishes first; the process exit ends the group
        self.stop_engine()
        # the worker closes in order: once it is closed, its process ends without the
        # interpreter's finalization of torch and transformers (seconds, a minute on a
        # loaded host, while its nanny waits for the process to exit)
        if _in_worker_process():
            atexit.register(_exit_now)

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


def torch_threads_from_env() -> None:
    """torch's intra-op thread count from ``OMP_NUM_THREADS``, where torch was imported
    before the cell's environment was set (a cell forked from the zygote,
    infra/cells/zygote.py); a fresh interpreter reads it when torch starts."""
    torch = sys.modules.get("torch")
    n = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and n.isdigit() and int(n) > 0 and torch.get_num_threads() != int(n):
        torch.set_num_threads(int(n))


def _in_worker_process() -> bool:
    """This process is a cell's worker process (started by a nanny), not a test's or a
    run's process that hosts workers in-process."""
    import multiprocessing

    return multiprocessing.parent_process() is not None


def _exit_now() -> None:
    """The last exit handler of a closed cell's process: flush the logs and output, exit."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _preload(modules: tuple[str, ...]) -> None:
    """Import ``modules`` (one thread, in order): a cell's first engine start and first
    task then find torch, transformers and the task modules imported, which took a cell
    10-60 s on a loaded host, while the run's process was still setting up. A module that
    fails to import here fails again, with its error, where it is used."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            log.debug("preloading %s: %s", name, exc)


def cell_name(worker_address: str) -> str:
    """A cell's id from its worker address: host and port, so that two hosts whose
    workers listen on the same port stay apart (``tcp://10.0.0.5:40123`` ->
    ``cell-10.0.0.5:40123``)."""
    return "cell-" + worker_address.split("://", 1)[-1]


def host_of(address: str) -> str:
    """The host of a worker or scheduler address (``tcp://10.0.0.5:40123`` -> ``10.0.0.5``)."""
    hostport = address.split("://", 1)[-1]
    return hostport.rpartition(":")[0].strip("[]") or hostport


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
    stopping: threading.Thread | None = field(default=None, repr=False)  # see stop_soon

    def stop_soon(self) -> None:
        """Start tearing the cells down (``stop_cells``) on a thread of its own, and return:
        the caller goes on with what needs no cell (a run's summary, learning curve and
        artifacts: 5-20 s, as long as the teardown itself) while the engines stop and the
        workers leave; the end of ``start_cells`` waits for the teardown to finish. No cell
        may be used after this."""
        if self.stopping is None:
            self.stopping = threading.Thread(
                target=stop_cells, args=(self.client, self.cluster), name="gyre-stop-cells"
            )
            self.stopping.start()

    @property
    def scheduler_address(self) -> str:
        return self.client.scheduler.address

    @property
    def dashboard_link(self) -> str | None:
        """The Dask dashboard of the cells' scheduler (None if it serves none)."""
        try:
            return self.client.dashboard_link
        except Exception:  # no dashboard service (bokeh missing, or turned off)
            return None

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
        self._check_alive(address)
        resources = {
            "rollout": self.rollout_slots if role == "rollout" else 0.0,
            "train": 1.0 if role == "train" else 0.0,
            "harness": self.harness_slots,
        }
        self._run(address, _set_resources, resources, timeout=60)
        self.client.run_on_scheduler(_schedule_unrunnable, address)
        self.roles[address] = role

    def run_on(self, address: str, fn, *args, **kwargs) -> Any:
        """Run ``fn(plugin, *args, **kwargs)`` on one cell, off the worker's event loop."""
        self._check_alive(address)
        return self._run(address, _call_on_plugin, fn, args, kwargs, timeout=600)

    def _run(self, address: str, fn, *args, timeout: float) -> Any:
        try:
            out = self.client.run(fn, *args, workers=[address], callback_timeout=timeout)
        except (OSError, KeyError) as exc:
            # a worker that died under the call: say so (a retry on its successor may work)
            if address not in self.workers():
                raise CellLost(f"cell {cell_name(address)}: its worker is gone ({exc})") from exc
            raise
        if address not in out:
            raise CellLost(f"cell {cell_name(address)}: its worker did not answer")
        return out[address]

    def _check_alive(self, address: str) -> None:
        # a call to a vanished worker would wait out Dask's 30 s connect timeout
        if address not in self.workers():
            raise CellLost(f"cell {cell_name(address)}: its worker is gone")

    def workers(self) -> set[str]:
        """Addresses of every worker the scheduler knows now (cells and spares).

        Asked of the scheduler each time, never read from the client's cache:
        ``Client.scheduler_info()`` returns the client's cached identity, which its own
        periodic refresh overwrites with one that lists no workers, and which stays
        stale when a refresh fails; under load (another run starting on the host) every
        cell then looked lost at once and the run stopped 120 s later. A failed query
        raises (the executor retries at its next look)."""
        return worker_addrs(self.client)

    def alive(self) -> set[str]:
        """Addresses of the cells the scheduler still knows (a dead cell drops out)."""
        return self.workers() & set(self.roles)

    def rebind(self, old: str, new: str, role: str = "idle") -> None:
        """Worker ``new`` takes the place of the cell that ``old`` held (which died)."""
        self.roles.pop(old, None)
        self.roles[new] = role

    def task_state(self, key: Any) -> str:
        """What the scheduler says of a task (for errors that name what was waited for)."""
        return self.task_states([key])[key]

    def task_states(self, keys: list[Any]) -> dict[Any, str]:
        """The scheduler's state of each task (``no-worker``, ``processing on <worker>``,
        ...); one call for all."""
        return self.client.run_on_scheduler(_task_states, list(keys))

    def pids(self) -> dict[str, int]:
        """Each worker's process id (tests kill cells by it)."""
        return self.client.run(os.getpid)


def _task_states(keys: list[Any], dask_scheduler=None) -> dict[Any, str]:
    out = {}
    for key in keys:
        ts = dask_scheduler.tasks.get(key)
        if ts is None:
            out[key] = "not known to the scheduler"
            continue
        where = f" on {ts.processing_on.address}" if ts.processing_on is not None else ""
        out[key] = f"{ts.state}{where}"
    return out


async def _set_resources(resources: dict[str, float], dask_worker=None) -> None:
    await dask_worker.set_resources(**resources)


def _schedule_unrunnable(address: str, dask_scheduler=None) -> int:
    """Send the ``no-worker`` tasks that worker ``address`` can now run to it.

    Dask looks at tasks waiting for a worker with their resources when a worker joins
    or resumes, not when a worker's resources change (``Scheduler.add_resources``). A
    rollout task whose cell died while no other cell held a ``harness`` slot (both cells
    lost at once; a restarted worker has no resources until it gets its role) waited
    forever although its cell came back. This does what the scheduler does for a worker
    that joins; returns how many tasks it sent."""
    from distributed.core import Status

    ws = dask_scheduler.workers.get(address)
    if ws is None or ws.status != Status.running:
        return 0
    recs = dask_scheduler.bulk_schedule_unrunnable_after_adding_worker(ws)
    if recs:
        dask_scheduler.transitions(recs, stimulus_id=f"gyre-set-role-{time.time()}")
    return len(recs)


async def _call_on_plugin(fn, args, kwargs, dask_worker=None):
    plugin = dask_worker.plugins[PLUGIN_NAME]
    return await asyncio.to_thread(fn, plugin, *args, **kwargs)


def _local_cluster(
    n: int, threads: int, memory_limit: str, env: dict[str, str], host: str = "127.0.0.1"
) -> LocalCluster:
    return LocalCluster(
        n_workers=n,
        threads_per_worker=threads,
        processes=True,
        memory_limit=memory_limit,
        dashboard_address=f"{host}:0",  # a free port: several runs may share a host
        host=host,
        worker_class="distributed.Nanny",
        env=env,
    )


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
    host: str = "127.0.0.1",
    token: str | None = None,
    preload: tuple[str, ...] = (),
) -> Iterator[Cells]:
    """Start (or connect to) a Dask cluster whose workers are the cells.

    ``scheduler_address`` connects to an external ``dask scheduler``; its
    workers become the cells. Otherwise a LocalCluster of worker *processes*, each with
    ``threads_per_cell`` threads for work plus one per harness slot (harnesses mostly wait
    on HTTP and their environment). ``host``: the address a LocalCluster (scheduler,
    workers, dashboard) binds; ``token``: the run's token, which each cell's engine requires
    when its worker's address is beyond loopback; ``preload``: modules each cell imports in
    the background as soon as it starts (the caller names them: the engine, the tasks).
    """
    cluster = client = cells = None
    lost = False  # the scheduler is gone: nothing to stop through it
    try:
        if scheduler_address:
            client = Client(scheduler_address, timeout="60s")
            wait_for_cells(client, n_cells, timeout=WORKERS_WAIT_S)
        else:
            worker_env = {"OMP_NUM_THREADS": "1", **(env or {})}
            # no statistical profiler in the cells (see stop_thread_profiler); the plugin
            # also stops it on workers of an external cluster and on restarted ones
            with dask.config.set({"distributed.worker.profile.enabled": False}):
                cluster = _local_cluster(
                    n_cells, threads_per_cell + harness_slots, memory_limit, worker_env, host
                )
            client = Client(cluster)
        client.register_plugin(CellPlugin(token, preload), name=PLUGIN_NAME)
        addrs = sorted(worker_addrs(client))[:n_cells]
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
    except Exception as exc:
        # whatever the call that noticed it raised (CommClosedError, OSError), say what it is
        if scheduler_address and _scheduler_gone(scheduler_address):
            lost = True
            raise SchedulerLost(
                f"the Dask scheduler at {scheduler_address} is gone (the run saw "
                f"{type(exc).__name__}: {exc}); start `dask scheduler` there again, "
                "with its workers"
            ) from exc
        raise
    finally:
        if client is None:
            pass
        elif cells is not None and cells.stopping is not None:
            cells.stopping.join()  # the teardown `stop_soon` started (it never raises)
        elif lost:
            try:
                client.close(timeout=LOST_CLOSE_TIMEOUT_S)
            except Exception as exc:
                log.warning("closing the Dask client: %s: %s", type(exc).__name__, exc)
        elif client is not None:
            stop_cells(client, cluster)


def stop_cells(client: Client, cluster: LocalCluster | None, timeout: float = CLOSE_TIMEOUT_S):
    """Stop every cell's engine, then let the workers leave on their own (bounded).

    Never raises: a run whose training is done must not fail while tearing down. A
    LocalCluster's nannies get ``timeout`` seconds for their worker processes to exit
    (Dask's default is 4 s, after which it kills them); an external cluster's workers are
    left running with their engines stopped.
    """
    t0 = time.monotonic()
    try:
        client.run(_stop_engine, callback_timeout=timeout, on_error="return")
    except Exception as exc:  # best effort: workers may already be gone
        log.warning("stopping engines: %s", exc)
    if cluster is not None:
        try:
            cluster.sync(_close_nannies, cluster, timeout)
        except Exception as exc:
            log.warning("closing cells: %s: %s", type(exc).__name__, exc)
    try:
        client.close(timeout=timeout)
    except Exception as exc:
        log.warning("closing the Dask client: %s: %s", type(exc).__name__, exc)
    if cluster is not None:
        try:
            cluster.close(timeout=timeout)
        except Exception as exc:
            log.warning("closing the cluster: %s: %s", type(exc).__name__, exc)
    log.info("cells stopped in %.1fs", time.monotonic() - t0)


async def _close_nannies(cluster: LocalCluster, timeout: float) -> None:
    nannies = [w for w in cluster.workers.values() if hasattr(w, "close")]
    results = await asyncio.gather(
        *(w.close(timeout=timeout, reason="gyre: run ended") for w in nannies),
        return_exceptions=True,
    )
    for r in results:
        if isinstance(r, BaseException):
            log.warning("a cell did not close cleanly: %s: %s", type(r).__name__, r)


def _stop_engine(dask_worker=None) -> None:
    # the DP group is left to the plugin's teardown: a step still running (a run stopped by
    # Ctrl-C) finishes its collectives first
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    if plugin is not None:
        plugin.stop_engine()


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
