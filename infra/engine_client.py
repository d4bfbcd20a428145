"""Async HTTP client for the SGLang-native engine API: the only way anything reaches an engine.

Works against the embedded `EngineServer` and a real SGLang server alike (same paths, same
field names). One keep-alive `httpx.AsyncClient` per client. Connection failures (refused,
reset, connect timeout) are retried a bounded number of times with backoff and logged with the
attempt count; everything else — a 4xx/5xx answer, a read timeout mid-generation — raises
`EngineError` carrying the server's message and status, because a generation may already have
run and must not be silently repeated.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import httpx

log = logging.getLogger(__name__)

CONNECT_RETRIES = 4
BACKOFF_S = 0.25


class EngineError(RuntimeError):
    """The engine answered an error (or could not be reached after retries)."""

    def __init__(self, message: str, *, status: int | None = None, url: str = ""):
        super().__init__(f"{url}: {message}" if url else message)
        self.status = status
        self.url = url
        self.server_message = message


def _message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text or resp.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return json.dumps(body)


class EngineClient:
    """Async client for one engine server at `base_url` (e.g. ``http://127.0.0.1:30000``)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        """`transport` replaces the network (tests pass an `httpx.MockTransport`)."""
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout, connect=min(10.0, timeout)),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            transport=transport,
        )

    # ------------------------------------------------------------------ transport
    async def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        for attempt in range(1, CONNECT_RETRIES + 1):
            try:
                resp = await self._http.request(method, path, **kwargs)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as e:
                # A RemoteProtocolError may come after the server took the request: retry it
                # only for reads, never a POST that may have generated.
                if isinstance(e, httpx.RemoteProtocolError) and method != "GET":
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
            except httpx.HTTPError as e:
                raise EngineError(f"{method} {path} failed: {e!r}", url=self.base_url) from e
            if resp.status_code >= 400:
                raise EngineError(_message(resp), status=resp.status_code, url=self.base_url)
            return resp
        raise AssertionError("unreachable")

    async def _json(self, method: str, path: str, **kwargs) -> dict:
        resp = await self._request(method, path, **kwargs)
        if not resp.content:
            return {}
        return resp.json()

    # ------------------------------------------------------------------ generation
    @staticmethod
    def _payload(input_ids, sampling_params, rid, return_logprob, stream) -> dict:
        payload = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
            "stream": stream,
        }
        if rid is not None:
            payload["rid"] = rid
        return payload

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> dict:
        """POST /generate; returns the response JSON (output_ids, meta_info, text)."""
        payload = self._payload(input_ids, sampling_params, rid, return_logprob, False)
        return await self._json("POST", "/generate", json=payload)

    async def generate_stream(
        self,
        input_ids: list[int],
        sampling_params: dict | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> AsyncIterator[dict]:
        """POST /generate with stream: yields each SSE chunk dict (cumulative), last one final."""
        payload = self._payload(input_ids, sampling_params, rid, return_logprob, True)
        for attempt in range(1, CONNECT_RETRIES + 1):
            try:
                async with self._http.stream("POST", "/generate", json=payload) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        raise EngineError(
                            _message(resp), status=resp.status_code, url=self.base_url
                        )
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            return
                        yield json.loads(data)
                return
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
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
            except httpx.HTTPError as e:
                raise EngineError(f"stream failed: {e!r}", url=self.base_url) from e

    # ------------------------------------------------------------------ control
    async def abort(self, rid: str) -> None:
        """Abort requests whose rid starts with `rid` (SGLang matches by prefix)."""
        await self._request("POST", "/abort_request", json={"rid": rid})

    async def pause(self, mode: str = "abort") -> None:
        await self._request("POST", "/pause_generation", json={"mode": mode})

    async def continue_(self) -> None:
        await self._request("POST", "/continue_generation", json={})

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
        return await self._json("POST", "/update_weights_from_disk", json=payload)

    async def flush_cache(self) -> None:
        try:
            await self._request("POST", "/flush_cache")
        except EngineError as e:
            if e.status != 405:
                raise
            await self._request("GET", "/flush_cache")  # older SGLang: GET only

    async def health(self) -> bool:
        try:
            resp = await self._http.get("/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

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

    async def export_kv(self, input_ids: list[int]) -> bytes:
        """gyre extension: the serialized KV of the engine's longest cached prefix of ids."""
        resp = await self._request("POST", "/gyre/kv/export", json={"input_ids": list(input_ids)})
        return resp.content

    async def import_kv(self, blob: bytes) -> int:
        """gyre extension: load an exported prefix into the engine's cache; returns tokens."""
        resp = await self._request(
            "POST",
            "/gyre/kv/import",
            content=blob,
            headers={"content-type": "application/octet-stream"},
        )
        return int(resp.json()["imported_tokens"])

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
