"""Serve an ASGI app from a background thread on uvicorn's fast stack (httptools + uvloop).

Used by the gateway and by the embedded engine's server: each runs its own event loop in its
own thread, so a caller (a flow, a test, a Dask worker) keeps its main thread.

Nagle: the listening socket is made with ``proto=IPPROTO_TCP``. Accepted connections then get
``TCP_NODELAY`` (asyncio sets it only for sockets that say TCP; with proto 0, Nagle stayed on
and a response written in two parts, head then body, waited ~40 ms for the peer's delayed
ACK). uvloop sets it on every TCP connection as well; the explicit protocol keeps the fix
whatever the loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
import uvloop

log = logging.getLogger(__name__)


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket whose accepted connections have Nagle off (see the module doc)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class ServerThread:
    """An ASGI app on uvicorn (httptools parser, uvloop loop) in a daemon thread."""

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "gyre-http",
        on_exit: Callable[[], Awaitable[None]] | None = None,
        timeout_keep_alive: int = 60,
    ):
        self.host = host
        self.port = port
        self.name = name
        self._on_exit = on_exit
        self._config = uvicorn.Config(
            app,
            http="httptools",
            ws="none",
            lifespan="off",
            # uvicorn's own logging setup (dictConfig) would close every handler of the
            # process: Prefect's API log handler flushes on close while holding logging's
            # lock, which its sender needs (a 5 s stall of `gyre run`), and the run's and
            # Dask's handlers are closed
            log_config=None,
            log_level="warning",
            access_log=False,
            server_header=False,
            date_header=False,
            timeout_keep_alive=timeout_keep_alive,
        )
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.url: str | None = None

    def start(self, timeout: float = 30.0) -> str:
        """Serve; return the base URL once the server accepts connections."""
        sock = listen_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        self._server = server = uvicorn.Server(self._config)
        ready = threading.Event()

        def run() -> None:
            loop = uvloop.new_event_loop()
            asyncio.set_event_loop(loop)
            self.loop = loop
            ready.set()
            try:
                loop.run_until_complete(server.serve(sockets=[sock]))
            finally:
                try:
                    if self._on_exit is not None:
                        loop.run_until_complete(self._on_exit())
                finally:
                    loop.close()
                    sock.close()

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        ready.wait(timeout)
        deadline = time.monotonic() + timeout
        while not server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"{self.name} on {self.host}:{self.port} did not start")
            time.sleep(0.005)
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    def call(self, coro: Awaitable, timeout: float | None = None) -> Any:
        """Run ``coro`` on the server's loop from another thread; its result."""
        if self.loop is None or self._thread is None or not self._thread.is_alive():
            raise RuntimeError(f"{self.name} is not running; call start() first")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 15.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                log.warning("%s did not stop within %.0f s", self.name, timeout)
        self._server = self._thread = self.loop = None
