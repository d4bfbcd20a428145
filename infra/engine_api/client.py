"""Async HTTP client for the SGLang-native engine API: the only way anything reaches an engine.

Works against the embedded `EngineServer` and a real SGLang server alike (same paths, same
field names). Requests go through `infra.engine_api.http1.Http1Pool`, a minimal keep-alive HTTP/1.1
client on raw asyncio (httpx cost ~1.5 ms of event-loop CPU per call, most of the gateway's
own overhead); ``https://`` URLs and tests' injected transports go through httpx. Connection
failures (refused, reset, connect timeout) are retried a bounded number of times with backoff
and logged with the attempt count; everything else — a 4xx/5xx answer, a read timeout
mid-generation — raises `EngineError` carrying the server's message and status, because a
generation may already have run and must not be silently repeated.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from infra.engine_api.http1 import Http1Pool
from infra.engine_api.transport import (
    AiohttpPool,
    ConnectFailed,
    Disconnected,
    HttpError,
    Response,
)

if TYPE_CHECKING:
    import httpx


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


_loads = orjson.loads


class JsonIds:
    """Token ids already encoded as the text of a JSON array, in parts (e.g. a session's
    cached prefix and its new ids: infra/gateway/ids_json.py), joined once into the request
    body. SGLang's HTTP ``/generate`` takes ``input_ids`` only as a JSON list (its binary
    form is the gRPC scheduler API's packed ``TokenizedInput.input_ids``, not served over
    HTTP), so re-sending a long context costs its encoding; this form pays it once."""

    __slots__ = ("n", "parts")

    def __init__(self, parts: list, n: int):
        self.parts = parts  # bytes-like pieces; b"[" + parts... + b"]" is the array
        self.n = n

    def __len__(self) -> int:
        return self.n


def _body(payload: dict) -> bytes:
    """The JSON body of a payload whose ``input_ids`` may be `JsonIds`."""
    ids = payload.get("input_ids")
    if not isinstance(ids, JsonIds):
        return _dumps(payload)
    rest = _dumps({k: v for k, v in payload.items() if k != "input_ids"})
    tail = [b"]}"] if rest == b"{}" else [b"],", memoryview(rest)[1:]]
    return b"".join([b'{"input_ids":[', *ids.parts, *tail])


log = logging.getLogger(__name__)

DEFAULT_TRANSPORT = "http1"  # for http:// (see BENCHMARKS.md, "Engine client")
CONNECT_RETRIES = 4
BACKOFF_S = 0.25
JSON = "application/json"


class EngineError(RuntimeError):
    """The engine answered an error (or could not be reached after retries)."""

    def __init__(self, message: str, *, status: int | None = None, url: str = ""):
        super().__init__(f"{url}: {message}" if url else message)
        self.status = status
        self.url = url
        self.server_message = message


def _message(resp: Response) -> str:
    try:
        body = _loads(resp.body)
    except ValueError:
        return resp.body.decode("utf-8", "replace") or resp.reason
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return _dumps(body).decode()


class _HttpxPool:
    """`Http1Pool`'s two verbs over httpx (an injected transport such as tests'
    ``MockTransport``, or https), with httpx's errors mapped onto `infra.engine_api.http1`'s."""

    def __init__(
        self,
        base_url: str,
        transport,
        connect_timeout: float,
        read_timeout: float,
        headers: dict[str, str] | None = None,
    ):
        import httpx

        self._httpx = httpx
        self._http = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(read_timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            transport=transport,
            headers=headers,
        )

    def _error(self, e: Exception) -> HttpError:
        httpx = self._httpx
        if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
            return ConnectFailed(repr(e))
        if isinstance(e, httpx.RemoteProtocolError):
            return Disconnected(repr(e))
        return HttpError(repr(e))

    def _args(self, body, content_type, timeout) -> dict:
        kw: dict = {"content": body}
        if body is not None:
            kw["headers"] = {"content-type": content_type}
        if timeout is not None:
            kw["timeout"] = timeout
        return kw

    async def request(self, method, path, body=None, *, content_type=JSON, timeout=None):
        try:
            r = await self._http.request(method, path, **self._args(body, content_type, timeout))
        except self._httpx.HTTPError as e:
            raise self._error(e) from e
        return Response(r.status_code, r.reason_phrase, dict(r.headers), r.content)

    async def stream(self, method, path, body=None, *, content_type=JSON, timeout=None):
        try:
            kw = self._args(body, content_type, timeout)
            async with self._http.stream(method, path, **kw) as r:
                yield Response(r.status_code, r.reason_phrase, dict(r.headers), b"")
                async for part in r.aiter_bytes():
                    yield part
        except self._httpx.HTTPError as e:
            raise self._error(e) from e

    async def aclose(self) -> None:
        await self._http.aclose()


class EngineClient:
    """Async client for one engine server at `base_url` (e.g. ``http://127.0.0.1:30000``)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 600.0,
        transport: str | httpx.AsyncBaseTransport | None = None,
        token: str | None = None,
    ):
        """``transport``: ``"http1"`` (`Http1Pool`, the default for ``http://``),
        ``"aiohttp"`` (the default for ``https://``), or an httpx transport (tests pass an
        `httpx.MockTransport`; ``httpx.AsyncHTTPTransport()`` is the former httpx path).
        ``token``: sent as ``Authorization: Bearer`` on every call (an engine bound beyond
        loopback requires the run's token; SGLang's ``--api-key`` the same way)."""
        self.base_url = base_url.rstrip("/")
        hdrs = {"Authorization": f"Bearer {token}"} if token else None
        self.timeout = timeout
        connect = min(10.0, timeout)
        if transport is None:
            transport = DEFAULT_TRANSPORT if self.base_url.startswith("http://") else "aiohttp"
        if transport == "http1":
            self._http = Http1Pool(
                self.base_url,
                connect_timeout=connect,
                read_timeout=timeout,
                max_idle=64,
                headers=hdrs,
            )
        elif transport == "aiohttp":
            self._http = AiohttpPool(
                self.base_url, connect_timeout=connect, read_timeout=timeout, headers=hdrs
            )
        elif isinstance(transport, str):
            raise ValueError(f"unknown transport {transport!r}: use 'http1' or 'aiohttp'")
        else:
            self._http = _HttpxPool(self.base_url, transport, connect, timeout, hdrs)

    # ------------------------------------------------------------------ transport
    async def _request(
        self, method: str, path: str, body: bytes | None = None, content_type: str = JSON
    ) -> Response:
        for attempt in range(1, CONNECT_RETRIES + 1):
            try:
                resp = await self._http.request(method, path, body, content_type=content_type)
            except (ConnectFailed, Disconnected) as e:
                # A disconnect may come after the server took the request: retry it only for
                # reads, never a POST that may have generated.
                if isinstance(e, Disconnected) and method != "GET":
                    raise EngineError(f"{method} {path} failed: {e!r}", url=self.base_url) from e
                if attempt == CONNECT_RETRIES:
                    raise EngineError(
                        f"cannot reach engine after {attempt} attempts: {e!r}", url=self.base_url
                    ) from e
                log.warning(
                    "engine %s%s unreachable (attempt %d/%d): %r",
                    self.base_url,
                    path,
                    attempt,
                    CONNECT_RETRIES,
                    e,
                )
                await asyncio.sleep(BACKOFF_S * 2 ** (attempt - 1))
                continue
            except HttpError as e:
                raise EngineError(f"{method} {path} failed: {e!r}", url=self.base_url) from e
            if resp.status >= 400:
                raise EngineError(_message(resp), status=resp.status, url=self.base_url)
            return resp
        raise AssertionError("unreachable")

    async def _json(self, method: str, path: str, payload: dict | None = None) -> dict:
        body = None if payload is None else _dumps(payload)
        resp = await self._request(method, path, body)
        if not resp.body:
            return {}
        return _loads(resp.body)

    # ------------------------------------------------------------------ generation
    @staticmethod
    def _payload(input_ids, sampling_params, rid, return_logprob, stream, prefix=None) -> dict:
        payload = {
            "input_ids": input_ids
            if isinstance(input_ids, np.ndarray | JsonIds)
            else list(input_ids),
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
            "stream": stream,
        }
        if rid is not None:
            payload["rid"] = rid
        if prefix is not None:  # the embedded engine's prefix handle (infra/engine/server.py)
            payload["prefix"] = {"rid": prefix[0], "len": int(prefix[1])}
        return payload

    async def generate(
        self,
        input_ids: list[int] | np.ndarray | JsonIds,
        sampling_params: dict | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
        prefix: tuple[str, int] | None = None,
    ) -> dict:
        """POST /generate; returns the response JSON (output_ids, meta_info, text). With
        ``prefix`` = (an earlier rid, k), ``input_ids`` are the ids after that call's first k
        context tokens (embedded engine only; EngineError status 409 when not held)."""
        payload = self._payload(input_ids, sampling_params, rid, return_logprob, False, prefix)
        resp = await self._request("POST", "/generate", _body(payload))
        return _loads(resp.body) if resp.body else {}

    async def generate_stream(
        self,
        input_ids: list[int] | np.ndarray,
        sampling_params: dict | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
        prefix: tuple[str, int] | None = None,
    ) -> AsyncIterator[dict]:
        """POST /generate with stream: yields each SSE chunk dict (cumulative), last one final
        (``prefix`` as in `generate`)."""
        body = _body(self._payload(input_ids, sampling_params, rid, return_logprob, True, prefix))
        for attempt in range(1, CONNECT_RETRIES + 1):
            try:
                async with aclosing(self._http.stream("POST", "/generate", body)) as parts:
                    resp = await anext(parts)
                    if resp.status >= 400:
                        resp.body = b"".join([p async for p in parts])
                        raise EngineError(_message(resp), status=resp.status, url=self.base_url)
                    pending = b""
                    async for part in parts:
                        lines = (pending + part).split(b"\n")
                        pending = lines.pop()  # an incomplete line waits for the next part
                        for line in lines:
                            if line.startswith(b"data:"):
                                data = line[5:].strip()
                                if data == b"[DONE]":
                                    return
                                yield _loads(data)
                    if pending.startswith(b"data:") and pending[5:].strip() != b"[DONE]":
                        yield _loads(pending[5:].strip())  # a last line without its newline
                return
            except ConnectFailed as e:
                if attempt == CONNECT_RETRIES:
                    raise EngineError(
                        f"cannot reach engine after {attempt} attempts: {e!r}", url=self.base_url
                    ) from e
                log.warning(
                    "engine %s/generate unreachable (attempt %d/%d): %r",
                    self.base_url,
                    attempt,
                    CONNECT_RETRIES,
                    e,
                )
                await asyncio.sleep(BACKOFF_S * 2 ** (attempt - 1))
            except HttpError as e:
                raise EngineError(f"stream failed: {e!r}", url=self.base_url) from e

    # ------------------------------------------------------------------ control
    async def abort(self, rid: str) -> None:
        """Abort requests whose rid starts with `rid` (SGLang matches by prefix)."""
        await self._request("POST", "/abort_request", _dumps({"rid": rid}))

    async def pause(self, mode: str = "abort") -> None:
        await self._request("POST", "/pause_generation", _dumps({"mode": mode}))

    async def continue_(self) -> None:
        await self._request("POST", "/continue_generation", b"{}")

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: int | str | None = None,
        *,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> dict:
        """Returns ``{"success": bool, "message": str}``; a refused load raises `EngineError`."""
        payload = {
            "model_path": str(model_path),
            "abort_all_requests": abort_all_requests,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self._json("POST", "/update_weights_from_disk", payload)

    @classmethod
    def update_weights_blocking(
        cls,
        base_url: str,
        model_path: str,
        weight_version: int | str | None = None,
        *,
        timeout: float = 600.0,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> dict:
        """`update_weights_from_disk` for a caller without an event loop (a Dask cell loading
        a checkpoint into its engine): a short-lived client on its own loop. Raises
        `EngineError` when the engine refuses the load (HTTP error or ``success: false``)."""

        async def run() -> dict:
            async with cls(base_url, timeout=timeout) as c:
                return await c.update_weights_from_disk(
                    model_path,
                    weight_version,
                    abort_all_requests=abort_all_requests,
                    flush_cache=flush_cache,
                )

        body = asyncio.run(run())
        if not body.get("success", False):
            raise EngineError(
                f"the engine refused {model_path} (version {weight_version}): "
                f"{body.get('message')}",
                url=base_url,
            )
        return body

    async def flush_cache(self) -> None:
        try:
            await self._request("POST", "/flush_cache")
        except EngineError as e:
            if e.status != 405:
                raise
            await self._request("GET", "/flush_cache")  # older SGLang: GET only

    async def health(self) -> bool:
        try:
            resp = await self._http.request("GET", "/health", timeout=5.0)
        except HttpError:
            return False
        return resp.status == 200

    async def model_info(self) -> dict:
        """``/get_model_info``, with ``max_context_length`` filled in from
        ``/get_server_info`` (``context_length``) when the server leaves it out, as SGLang does.
        """
        info = await self._json("GET", "/get_model_info")
        if "max_context_length" not in info:
            try:
                server = await self.server_info()
            except EngineError:
                server = {}
            ctx = server.get("context_length") or server.get("max_context_length")
            if ctx:
                info["max_context_length"] = int(ctx)
        return info

    async def server_info(self) -> dict:
        return await self._json("GET", "/get_server_info")

    async def weight_version(self) -> str:
        return str((await self._json("GET", "/get_weight_version"))["weight_version"])

    async def weights_digest(self) -> tuple[str | None, str | None]:
        """``(sha256 of the served weights, their dtype)`` from ``/get_model_info``; the
        digest is None for an engine that does not report one (SGLang)."""
        info = await self._json("GET", "/get_model_info")
        return info.get("weights_digest"), info.get("dtype")

    async def export_kv(self, input_ids: list[int]) -> bytes:
        """gyre extension: the serialized KV of the engine's longest cached prefix of ids."""
        resp = await self._request(
            "POST", "/gyre/kv/export", _dumps({"input_ids": np.asarray(input_ids, dtype=np.int64)})
        )
        return resp.body

    async def import_kv(self, blob: bytes) -> int:
        """gyre extension: load an exported prefix into the engine's cache; returns tokens."""
        resp = await self._request(
            "POST", "/gyre/kv/import", bytes(blob), "application/octet-stream"
        )
        return int(_loads(resp.body)["imported_tokens"])

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
