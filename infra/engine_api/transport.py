"""HTTP transport of `EngineClient`: aiohttp, with errors typed for the client's retry policy.

The engine API needs little of HTTP: one origin, small JSON bodies (plus a binary KV blob),
``Content-Length`` or ``chunked`` answers (SSE is chunked), keep-alive. aiohttp does that at
~0.2 ms of event-loop CPU per call (httpx: ~1.5-10 ms, most of it in its anyio layer and
models; see BENCHMARKS.md, "Engine client").

Errors are typed so that the caller can keep its retry policy: `ConnectFailed` (nothing was
sent: always safe to retry), `Disconnected` (the server closed or reset the connection before a
complete answer: the request may have run), `ReadTimeout`, and `HttpError` for the rest.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp


class HttpError(Exception):
    """Base of the transport errors below."""


class ConnectFailed(HttpError):
    """The connection could not be opened (refused, unreachable, connect timeout)."""


class Disconnected(HttpError):
    """The connection closed or broke before the answer was complete."""


class ReadTimeout(HttpError):
    """An awaited part of the answer took longer than the read timeout."""


class Response:
    """A complete answer: status, reason, lower-cased headers, body bytes."""

    __slots__ = ("body", "headers", "reason", "status")

    def __init__(self, status: int, reason: str, headers: dict[str, str], body: bytes):
        self.status = status
        self.reason = reason
        self.headers = headers
        self.body = body


def _typed(exc: BaseException) -> HttpError:
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        return ConnectFailed(repr(exc))
    if isinstance(exc, aiohttp.ServerTimeoutError | asyncio.TimeoutError):
        return ReadTimeout(repr(exc))
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError | OSError):
        return Disconnected(repr(exc))
    return HttpError(repr(exc))


class AiohttpPool:
    """Keep-alive connections to one origin; ``request`` answers whole, ``stream`` in parts.

    The aiohttp session is made on first use, on the event loop that uses it (the client may be
    constructed outside a running loop).
    """

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float = 10.0,
        read_timeout: float = 600.0,
        max_connections: int = 256,
        headers: dict[str, str] | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.headers = dict(headers or {})
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[float | None, aiohttp.ClientTimeout] = {}

    def _timeout(self, read: float | None) -> aiohttp.ClientTimeout:
        t = self._timeouts.get(read)
        if t is None:  # sock_read: between two reads, so a long stream with steady chunks lives
            r = self.read_timeout if read is None else read
            t = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout, sock_read=r)
            self._timeouts[read] = t
        return t

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self.max_connections, ttl_dns_cache=None, enable_cleanup_closed=False
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
                headers=self.headers,
            )
        return self._session

    def _args(self, body: bytes | None, content_type: str, timeout: float | None) -> dict:
        kw: dict = {"timeout": self._timeout(timeout)}
        if body is not None:
            kw["data"] = body
            kw["headers"] = {"Content-Type": content_type}
        return kw

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        content_type: str = "application/json",
        timeout: float | None = None,
    ) -> Response:
        try:
            async with self._http().request(
                method, self.base_url + path, **self._args(body, content_type, timeout)
            ) as r:
                data = await r.read()
                return Response(r.status, r.reason or "", dict(r.headers), data)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _typed(exc) from exc

    async def stream(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        content_type: str = "application/json",
        timeout: float | None = None,
    ) -> AsyncIterator[Response | bytes]:
        """Yields the answer's head (a `Response` with an empty body), then its body parts."""
        try:
            async with self._http().request(
                method, self.base_url + path, **self._args(body, content_type, timeout)
            ) as r:
                yield Response(r.status, r.reason or "", dict(r.headers), b"")
                async for part in r.content.iter_any():
                    yield part
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _typed(exc) from exc

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
