"""Cells forked from a copy of the run's process instead of started as fresh interpreters.

A cell started by Dask's default ``spawn`` is a new Python that imports distributed, torch,
transformers, prefect and the engine again: about 7 CPU seconds per cell, most of a short
run's start on a small host (``bench/smoke.py``). ``gyre run``'s own process has imported
them already. Right after those imports, while it is still a single thread, `start_zygote`
forks it once: the copy (the *zygote*) imports what else the cells need and then serves as
multiprocessing's fork server. Dask's nannies start (and restart) their worker processes
with the ``forkserver`` method, so every cell is a fork of the zygote and starts with
everything imported, in a fraction of a second.

What a fork shares that a fresh interpreter would not, and how each is handled:

- signal handlers: the zygote puts back Python's defaults (the run's process has its stop
  handlers), which the fork server restores in each cell; a cell then sets its own in its
  plugin's setup (infra/cells/cluster.py);
- random state: each cell reseeds NumPy's and torch's generators after the fork (Python's
  ``random`` reseeds itself);
- environment: Dask's nanny applies a cell's environment after the fork, and the cell's
  plugin gives torch the thread count of ``OMP_NUM_THREADS``
  (`infra.cells.cluster.torch_threads_from_env`), which a fresh interpreter reads when torch
  starts;
- lifetime: the zygote dies with the run's process (``PR_SET_PDEATHSIG``), and otherwise
  ends once every holder of its "alive" pipe (the run's process, the cells) is gone, as a
  fork server does. Its processes are named ``gyre-zygote`` and ``gyre-cell`` (``ps -o
  comm``, ``top``); their command line is the run's.

Only the fork server's own three fields (address, "alive" pipe, pid) are set here, as
``multiprocessing.forkserver.ForkServer.ensure_running`` sets them for a server it spawns.
Where that cannot be done (not Linux, a second thread already running, a Python whose fork
server differs) `start_zygote` returns None and the cells start with ``spawn`` as before.
If the zygote dies mid-run, every nanny sees its cell as ended (the cell's status pipe
closes with the zygote) and starts it again through a fresh fork server that
multiprocessing launches: the run heals them as lost cells.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import signal
import socket
import sys
import threading

import psutil

log = logging.getLogger(__name__)

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1
_FIELDS = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_lock")
_zygote: dict[str, int | None] = {"pid": None}


def zygote_pid() -> int | None:
    """The pid of this process's zygote while it runs, else None. (It does not reap an
    ended zygote: multiprocessing's fork server does, before it starts a fresh one.)"""
    pid = _zygote["pid"]
    if pid is None:
        return None
    try:
        if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            return pid
    except psutil.Error:
        pass
    _zygote["pid"] = None
    return None


def start_zygote(preload: tuple[str, ...] = ()) -> int | None:
    """Fork this process into a zygote that serves as multiprocessing's fork server, and
    make Dask's nannies start their workers from it; its pid, or None where that cannot be
    done (see the module doc). ``preload``: modules the zygote imports before it serves
    (beyond what this process has imported)."""
    if (pid := zygote_pid()) is not None:
        return pid
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if (
        not sys.platform.startswith("linux")
        or threading.active_count() != 1
        or server is None
        or not all(hasattr(server, f) for f in _FIELDS)
    ):
        return None
    from multiprocessing import connection, resource_tracker, util

    import dask
    import distributed.utils

    resource_tracker.ensure_running()  # before the fork: the cells share the run's tracker
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    if not util.is_abstract_socket_namespace(address):
        os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
        with contextlib.suppress(Exception):
            stream.flush()
    try:
        pid = os.fork()
    except OSError as exc:  # out of processes or memory: the cells are spawned
        log.warning("could not fork the cells' zygote (%s); cells start as new processes", exc)
        for fd in (alive_r, alive_w):
            os.close(fd)
        listener.close()
        return None
    if pid == 0:
        code = 1
        try:
            os.close(alive_w)
            _become_zygote(preload)
            forkserver.main(listener.fileno(), alive_r, [])
            code = 0
        except SystemExit:  # the fork server's end: every holder of "alive" is gone
            code = 0
        except BaseException:
            with contextlib.suppress(Exception):
                sys.excepthook(*sys.exc_info())
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os._exit(code)
    os.close(alive_r)
    listener.close()
    with server._lock:
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    # Dask's forkserver context would import numpy, pandas and lz4 into this process to
    # preload them into a fork server it starts; the zygote is that server
    if hasattr(distributed.utils, "_forkserver_preload_set"):
        distributed.utils._forkserver_preload_set = True
    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
    _zygote["pid"] = pid
    return pid


def _set_name(name: str) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def die_with_parent() -> None:
    """This process gets SIGTERM when its parent dies, even by SIGKILL (Linux; elsewhere
    nothing). Also `gyre run`'s temporary Prefect server (flows/procs.py) calls it."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _become_zygote(preload: tuple[str, ...]) -> None:
    """In the forked copy: tied to the run's process, ``preload`` imported, each cell
    forked from here reseeded, and Python's default signal handlers for the cells."""
    _set_name("gyre-zygote")
    die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the run, while importing
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as exc:  # it fails again, with its error, where a cell imports it
            log.debug("zygote: importing %s: %s", name, exc)
    os.register_at_fork(after_in_child=_as_cell)
    # the fork server ignores SIGINT itself and gives each cell back the handler it found
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _as_cell() -> None:
    """A cell just forked from the zygote: its own name and random state."""
    _set_name("gyre-cell")
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
