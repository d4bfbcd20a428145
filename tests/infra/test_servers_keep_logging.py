"""Starting an HTTP server in-process leaves the process's logging alone.

uvicorn's default start runs ``logging.config.dictConfig``, which flushes and closes every
handler in the process. In a run that meant Prefect's API log handler flushed while holding
logging's lock, which its own sender thread needed: `gyre run` stalled 5 s at "cells and
gateway up" whenever logs were queued, and the handlers of the run and of Dask were closed.
"""

import logging

import pytest

from infra.engine.engine import Engine
from infra.engine.server import EngineServer
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.server import ServerThread


class _Probe(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.flushes = 0
        self.closes = 0

    def emit(self, record: logging.LogRecord) -> None:
        pass

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        self.closes += 1
        super().close()


@pytest.fixture
def probe():
    h = _Probe()
    root = logging.getLogger()
    root.addHandler(h)
    try:
        yield h
    finally:
        root.removeHandler(h)


async def _app(scope, receive, send):  # a bare ASGI app: the test never calls it
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def _untouched(h: _Probe) -> None:
    assert (h.flushes, h.closes) == (0, 0), "the server's start flushed or closed a handler"
    assert h in logging.getLogger().handlers
    assert any(ref() is h for ref in logging._handlerList)


def test_the_gateways_server_leaves_handlers_open(probe):
    srv = ServerThread(_app, name="probe-http")
    srv.start()
    srv.stop()
    _untouched(probe)


@pytest.mark.integration
def test_an_engine_server_leaves_a_cells_handlers_open(probe, tmp_path):
    eng = Engine(make_tiny_model(tmp_path / "m", seed=0))
    try:
        srv = EngineServer(eng)
        srv.start()
        srv.stop()
    finally:
        eng.close()
    _untouched(probe)
