"""The processes of a ``gyre run``: its temporary Prefect server, its cells, and their end.

- **A temporary Prefect API server of its own.** Without ``PREFECT_API_URL`` Prefect would
  start one in the run's process group, where Ctrl-C in a terminal stops it at the same
  moment as the run, so the run could not record how it ended. gyre starts the same server
  (Prefect's own app, as Prefect starts it) in a session of its own, tied to the run's
  process (Linux: it is sent SIGTERM when the run's process dies, even by SIGKILL) and
  stops it when the run ends.
- **Orphans are reaped by the next start.** Each run records the processes it started
  (``$GYRE_CACHE/procs/<pid>.json``: pid and start time of each); a later ``gyre run`` stops
  those of a run whose process is gone (a SIGKILL, a lost terminal), so no Prefect server
  or cell outlives its run for long. Cells also die with the run's process by themselves
  (Dask's worker processes watch their parent).
- **A bounded stop.** The first Ctrl-C (or SIGTERM) asks the run to stop: the loop ends
  (at its next tick: the scheduling loop takes the request at a ``check_stop()``, never in
  the middle of a library call), rollouts are told to stop, answered calls are flushed to
  the store, cells stop their engines and leave. If that takes more than ``STOP_BOUND_S``,
  or on a second Ctrl-C, the run's processes are killed and it exits at once (exit status
  130).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from infra.cells.zygote import die_with_parent
from storage.paths import cache_dir

log = logging.getLogger(__name__)

STOP_BOUND_S = 60.0  # from the first Ctrl-C to exit, at most (then everything is killed)
SERVER_START_TIMEOUT_S = 180.0  # Prefect's first start migrates its database (~20 s)


def _records_dir() -> Path:
    return cache_dir() / "procs"


def _ident(p: psutil.Process) -> dict:
    return {"pid": p.pid, "created": p.create_time(), "cmd": " ".join(p.cmdline()[:6])}


def _same(rec: dict) -> psutil.Process | None:
    """The process a record names, if it is still that process (pids are reused)."""
    try:
        p = psutil.Process(rec["pid"])
        if abs(p.create_time() - rec["created"]) < 1e-3:
            return p
    except (psutil.Error, KeyError):
        pass
    return None


def record_children(extra: list[int] = ()) -> None:
    """Record this process and every process below it (plus ``extra`` pids started in
    sessions of their own), so that a later start can stop them if this one is killed."""
    me = psutil.Process()
    procs = me.children(recursive=True)
    for pid in extra:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    rec = {"owner": _ident(me), "children": [_ident(p) for p in procs if p.is_running()]}
    d = _records_dir()
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{me.pid}.json.tmp"
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, d / f"{me.pid}.json")


def forget() -> None:
    """This run ended cleanly: nothing to reap."""
    with contextlib.suppress(FileNotFoundError):
        (_records_dir() / f"{os.getpid()}.json").unlink()


def reap_orphans(grace_s: float = 5.0) -> list[int]:
    """Stop the processes of earlier runs whose own process is gone; returns their pids."""
    d = _records_dir()
    if not d.is_dir():
        return []
    reaped = []
    for f in sorted(d.glob("*.json")):
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if _same(rec["owner"]) is not None:
            continue  # that run is alive
        left = [p for p in (_same(c) for c in rec["children"]) if p is not None]
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(left, timeout=grace_s)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        reaped += [p.pid for p in left]
        if left:
            log.warning(
                "stopped %d process(es) left by run process %d (killed): %s",
                len(left),
                rec["owner"]["pid"],
                ", ".join(c["cmd"] for c in rec["children"] if c["pid"] in reaped),
            )
        with contextlib.suppress(FileNotFoundError):
            f.unlink()
    return reaped


def kill_children() -> None:
    """SIGKILL every process below this one (the last resort of a stop)."""
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            p.kill()


# -- the temporary Prefect server ----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def prefect_api(while_starting: Callable[[], object] | None = None) -> Iterator[str | None]:
    """The Prefect API the run talks to: ``PREFECT_API_URL`` if set (a ``prefect server``
    or Cloud), else a temporary server of its own for the duration of the block (its URL
    is put into ``PREFECT_API_URL``; call this before importing prefect).

    ``while_starting`` runs while the server starts, with ``PREFECT_API_URL`` already set
    (the port is chosen first): ``gyre run`` imports its flow there (prefect, torch,
    transformers: about as long as the server's own start), instead of after it."""
    if os.environ.get("PREFECT_API_URL"):
        if while_starting is not None:
            while_starting()
        try:
            yield os.environ["PREFECT_API_URL"]
        finally:
            _drain_prefect()  # `gyre run` ends with os._exit: queued logs go out first
        return
    spec = importlib.util.find_spec("prefect")  # where it is, without importing it
    app_dir = str(Path(spec.origin).parent.parent)
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        # what Prefect's own temporary server runs with (prefect/server/api/server.py)
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "uvicorn",
        "--app-dir",
        app_dir,
        "--factory",
        "prefect.server.api.server:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
        "--lifespan",
        "on",
    ]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_parent)
    print(f"gyre run: temporary Prefect server on {url[:-4]} (pid {proc.pid})", file=sys.stderr)
    try:
        os.environ["PREFECT_API_URL"] = url  # before prefect is imported, if it is here
        if while_starting is not None:
            while_starting()
        _wait_healthy(proc, url, SERVER_START_TIMEOUT_S)
        record_children(extra=[proc.pid])
        yield url
    finally:
        _drain_prefect()  # logs and events still queued go out before the server stops
        os.environ.pop("PREFECT_API_URL", None)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _drain_prefect(timeout: float = 10.0) -> None:
    if "prefect" not in sys.modules:
        return
    try:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=timeout)
        EventsWorker.drain_all(timeout=timeout)
    except Exception as exc:  # best effort: the run's outcome does not depend on it
        log.warning("flushing Prefect's logs: %s", exc)


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the temporary Prefect server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(
        f"the temporary Prefect server did not answer within {timeout:.0f}s; start one with "
        "`prefect server start` and set PREFECT_API_URL"
    )


# -- stopping --------------------------------------------------------------------------


class StopRequested(KeyboardInterrupt):
    """Ctrl-C or SIGTERM: the run stops (a KeyboardInterrupt, so nothing catches it)."""


_stop: dict = {"points": 0, "requested": None}  # inside `stop_points`: deferred to a check


@contextlib.contextmanager
def stop_points() -> Iterator[None]:
    """Inside, a stop request is raised by the next `check_stop()`, not wherever the main
    thread happens to be: raised inside a library it can turn into another error (pydantic's
    serializer, which Prefect runs on every task submit, wraps it in its own), and the run
    would end as failed, with a traceback, instead of stopped. The scheduling loop checks
    every tick; the stop bound still kills a loop that stopped checking."""
    _stop["points"] += 1
    try:
        yield
    finally:
        _stop["points"] -= 1


def check_stop() -> None:
    """Raise the stop request that `stop_points` deferred (if any)."""
    if _stop["requested"] is not None:
        raise StopRequested(_stop["requested"])


@contextlib.contextmanager
def bounded_stop(bound_s: float = STOP_BOUND_S) -> Iterator[None]:
    """First Ctrl-C/SIGTERM: raise `StopRequested` in the main thread and give the run
    ``bound_s`` to wind down; after that, or at a second signal, kill everything."""
    state: dict = {"stopping": False, "name": ""}

    def abort(why: str) -> None:
        print(f"\ngyre run: {why}; killing the run's processes", file=sys.stderr, flush=True)
        kill_children()
        os._exit(130)

    def handler(signum, _frame) -> None:
        if state["stopping"]:
            abort("stopped again")
        state["stopping"] = True
        state["name"] = name = signal.Signals(signum).name
        print(
            f"\ngyre run: {name}: stopping (at most {bound_s:.0f}s; Ctrl-C again to abort now)",
            file=sys.stderr,
            flush=True,
        )
        timer = threading.Timer(bound_s, abort, args=(f"not stopped within {bound_s:.0f}s",))
        timer.daemon = True
        timer.start()
        if _stop["points"]:
            _stop["requested"] = name  # raised by the loop's next `check_stop()`
            return
        raise StopRequested(name)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    _stop["requested"] = None
    try:
        yield
    except Exception as exc:
        if state["stopping"]:  # the stop ended the run through a library that wrapped it
            raise StopRequested(state["name"]) from exc
        raise
    finally:
        _stop["requested"] = None
        for s, h in old.items():
            signal.signal(s, h)
