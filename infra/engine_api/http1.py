"""A minimal HTTP/1.1 keep-alive client over raw asyncio: what `EngineClient` sends calls through.

Why not httpx: on this machine one httpx request costs ~1.5 ms of event-loop CPU (request and
response models, header normalisation, an anyio layer, the pool's bookkeeping), which is most of
the gateway's added latency per call. The engine API needs very little of HTTP: one origin,
small JSON bodies (plus a binary KV blob), ``Content-Length`` or ``chunked`` answers (SSE is
chunked), keep-alive. This does exactly that on an `asyncio.Protocol`, at a small fraction of
the cost.

Errors are those of `infra.engine_api.transport` (shared with the aiohttp transport), plus
`ProtocolViolation`.
"""

from __future__ import annotations

import asyncio
import select
import socket
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

from infra.engine_api.transport import ConnectFailed, Disconnected, HttpError, ReadTimeout, Response


class ProtocolViolation(HttpError):
    """The server's answer is not HTTP/1.1 this client understands."""


class _Conn(asyncio.Protocol):
    """One TCP connection; the reader side is a byte buffer a coroutine waits on."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.sock = None
        self.buf = bytearray()
        self.need = 0  # wake the waiter once len(buf) >= need
        self.waiter: asyncio.Future | None = None
        self.eof = False
        self.exc: BaseException | None = None
        self.idle_since = 0.0

    # -- protocol callbacks (event loop) ---------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.sock = transport.get_extra_info("socket")

    def data_received(self, data: bytes) -> None:
        self.buf += data
        w = self.waiter
        if w is not None and len(self.buf) >= self.need and not w.done():
            w.set_result(None)

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: BaseException | None) -> None:
        self.eof = True
        self.exc = exc
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- reading (coroutine side) ----------------------------------------------------------
    @property
    def usable(self) -> bool:
        return not self.eof and self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.eof = True

    async def _wait(self, need: int, timeout: float) -> None:
        """Until ``len(buf) >= need``; raises `Disconnected` at EOF, `ReadTimeout` when those
        bytes have not all arrived within ``timeout`` seconds."""
        while len(self.buf) < need:
            if self.eof:
                raise Disconnected(f"server closed the connection ({self.exc!r})")
            self.need = need
            self.waiter = w = self.loop.create_future()
            timer = self.loop.call_later(timeout, _expire, w)
            try:
                await w
            finally:
                timer.cancel()
                self.waiter = None

    async def read_until(self, sep: bytes, timeout: float, limit: int = 1 << 16) -> bytes:
        start = 0
        while True:
            i = self.buf.find(sep, start)
            if i >= 0:
                out = bytes(self.buf[:i])
                del self.buf[: i + len(sep)]
                return out
            if len(self.buf) > limit:
                raise ProtocolViolation(f"no {sep!r} within {limit} bytes")
            start = max(0, len(self.buf) - len(sep) + 1)
            await self._wait(len(self.buf) + 1, timeout)

    async def read_exactly(self, n: int, timeout: float) -> bytes:
        if len(self.buf) < n:
            await self._wait(n, timeout)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def read_some(self, timeout: float) -> bytes:
        """What is buffered, or the next bytes to arrive; b"" at EOF."""
        if not self.buf:
            if self.eof:
                return b""
            try:
                await self._wait(1, timeout)
            except Disconnected:
                return b""
        out = bytes(self.buf)
        self.buf.clear()
        return out


def _readable(sock) -> bool:
    """Whether ``sock`` has bytes or EOF waiting (poll, not select: no 1024-fd limit)."""
    try:
        p = select.poll()
        p.register(sock.fileno(), select.POLLIN)
        return bool(p.poll(0))
    except (OSError, ValueError):
        return True


def _expire(w: asyncio.Future) -> None:
    if not w.done():
        w.set_exception(ReadTimeout("read timed out"))


class _Answer:
    """Status and headers of an answer whose body is still on the connection."""

    __slots__ = ("chunked", "close", "headers", "length", "reason", "status")

    def __init__(self, status: int, reason: str, headers: dict[str, str]):
        self.status = status
        self.reason = reason
        self.headers = headers
        te = headers.get("transfer-encoding", "").lower()
        self.chunked = "chunked" in te
        cl = headers.get("content-length")
        self.length = int(cl) if cl is not None and not self.chunked else None
        self.close = "close" in headers.get("connection", "").lower()
        if status in (204, 304) or 100 <= status < 200:
            self.length = 0


class Http1Pool:
    """Keep-alive HTTP/1.1 connections to one origin (``http://host:port``).

    ``request`` and ``stream`` are the two verbs; both run on the caller's event loop. Up to
    ``max_connections`` requests run at once (others wait); up to ``max_idle`` idle connections
    are kept for reuse, each for at most ``max_idle_s`` seconds.
    """

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float = 10.0,
        read_timeout: float = 600.0,
        max_connections: int = 256,
        max_idle: int = 64,
        max_idle_s: float = 3.0,
        headers: dict[str, str] | None = None,
    ):
        u = urlsplit(base_url)
        if u.scheme != "http":
            raise ValueError(f"only http:// engine URLs are supported, got {base_url!r}")
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/")
        self._host_header = u.netloc
        # sent with every request (an engine's ``Authorization``); checked once, here
        items = list((headers or {}).items())
        if any(c in k + v for k, v in items for c in "\r\n"):
            raise ValueError("a header may not contain a line break")
        self._extra_head = "".join(f"{k}: {v}\r\n" for k, v in items)
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle
        self.max_idle_s = max_idle_s  # uvicorn (SGLang, EngineServer) closes idle ones at 5 s
        self._idle: list[_Conn] = []
        self._sem = asyncio.Semaphore(max_connections)
        self._closed = False

    # -- connections -----------------------------------------------------------------------
    async def _connect(self, timeout: float) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(min(self.connect_timeout, timeout)):
                _, conn = await loop.create_connection(
                    lambda: _Conn(loop), self.host, self.port, proto=socket.IPPROTO_TCP
                )
        except TimeoutError as e:
            raise ConnectFailed(f"connect to {self.host}:{self.port} timed out") from e
        except OSError as e:
            raise ConnectFailed(f"connect to {self.host}:{self.port} failed: {e!r}") from e
        return conn

    async def _acquire(self, timeout: float) -> _Conn:
        """An idle connection the server has not closed, else a new one."""
        while self._idle:
            conn = self._idle.pop()
            # The loop may not have seen the server's FIN yet: a readable idle socket means
            # EOF (or stray bytes), either way not reusable. A connection idle for nearly the
            # server's keep-alive timeout is dropped too: the server may close it while our
            # request is on the way (a reset; for a POST, an error rather than a retry).
            fresh = conn.loop.time() - conn.idle_since < self.max_idle_s
            if fresh and conn.usable and not conn.buf and not _readable(conn.sock):
                return conn
            conn.close()
        return await self._connect(timeout)

    def _release(self, conn: _Conn, reusable: bool) -> None:
        if reusable and not self._closed and conn.usable and len(self._idle) < self.max_idle:
            conn.idle_since = conn.loop.time()
            self._idle.append(conn)
        else:
            conn.close()

    def _head(self, method: str, path: str, body: bytes | None, content_type: str) -> bytes:
        lines = f"{method} {self.prefix}{path} HTTP/1.1\r\nHost: {self._host_header}\r\n"
        lines += self._extra_head
        if body is not None:
            lines += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        return (lines + "\r\n").encode("latin-1")

    async def _send(
        self, method: str, path: str, body: bytes | None, content_type: str, timeout: float
    ) -> tuple[_Conn, _Answer]:
        """Write the request and read the answer's head; the connection is closed on failure."""
        head = self._head(method, path, body, content_type)
        conn = await self._acquire(timeout)
        try:
            if body is None:
                conn.transport.write(head)
            elif len(body) < 65536:
                conn.transport.write(head + body)
            else:
                conn.transport.writelines((head, body))
            return conn, await self._read_head(conn, timeout)
        except BaseException:
            conn.close()
            raise

    async def _read_head(self, conn: _Conn, timeout: float) -> _Answer:
        while True:
            raw = await conn.read_until(b"\r\n\r\n", timeout)
            lines = raw.decode("latin-1").split("\r\n")
            parts = lines[0].split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
                raise ProtocolViolation(f"bad status line {lines[0]!r}")
            try:
                status = int(parts[1])
            except ValueError as e:
                raise ProtocolViolation(f"bad status line {lines[0]!r}") from e
            if status != 101 and 100 <= status < 200:
                continue  # interim answer (100 Continue): the real one follows
            headers = {}
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if not sep:
                    raise ProtocolViolation(f"bad header line {line!r}")
                headers[name.strip().lower()] = value.strip()
            return _Answer(status, parts[2] if len(parts) > 2 else "", headers)

    async def _body_parts(
        self, conn: _Conn, answer: _Answer, timeout: float
    ) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked, by length, or until the server closes)."""
        if answer.chunked:
            while True:
                size_line = await conn.read_until(b"\r\n", timeout)
                try:
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                except ValueError as e:
                    raise ProtocolViolation(f"bad chunk size {size_line!r}") from e
                if size == 0:
                    while await conn.read_until(b"\r\n", timeout):
                        pass  # trailers
                    return
                data = await conn.read_exactly(size + 2, timeout)
                yield data[:-2]
        elif answer.length is not None:
            left = answer.length
            while left > 0:
                data = await conn.read_some(timeout)
                if not data:
                    raise Disconnected(f"server closed with {left} body bytes still to come")
                if len(data) > left:
                    raise ProtocolViolation("more body bytes than Content-Length")
                left -= len(data)
                yield data
        else:
            answer.close = True
            while data := await conn.read_some(timeout):
                yield data

    async def _read_body(self, conn: _Conn, answer: _Answer, timeout: float) -> bytes:
        n = answer.length
        if n is not None and not answer.chunked:  # the common case: one slice, no iteration
            return await conn.read_exactly(n, timeout) if n else b""
        return b"".join([part async for part in self._body_parts(conn, answer, timeout)])

    # -- verbs -----------------------------------------------------------------------------
    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        content_type: str = "application/json",
        timeout: float | None = None,
    ) -> Response:
        """Send one request and read the whole answer."""
        timeout = self.read_timeout if timeout is None else timeout
        async with self._sem:
            conn, answer = await self._send(method, path, body, content_type, timeout)
            ok = False
            try:
                data = await self._read_body(conn, answer, timeout)
                ok = True
            finally:
                self._release(conn, ok and not answer.close)
        return Response(answer.status, answer.reason, answer.headers, data)

    async def stream(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        content_type: str = "application/json",
        timeout: float | None = None,
    ) -> AsyncIterator[Response | bytes]:
        """Send one request; yield a `Response` with an empty body (status and headers), then
        the body's bytes as they arrive. Closing the iterator early closes the connection (the
        server sees the hang-up)."""
        timeout = self.read_timeout if timeout is None else timeout
        async with self._sem:
            conn, answer = await self._send(method, path, body, content_type, timeout)
            ok = False
            try:
                yield Response(answer.status, answer.reason, answer.headers, b"")
                async for part in self._body_parts(conn, answer, timeout):
                    yield part
                ok = True
            finally:
                self._release(conn, ok and not answer.close)

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
