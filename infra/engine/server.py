"""SGLang's native HTTP API over the embedded `Engine` (Starlette + uvicorn, background thread).

Field names follow SGLang 0.5.x (DESIGN.md §5) so that `EngineClient`, the gateway and the
SGLang adapter treat this server and a real SGLang server alike. Streaming (`"stream": true`)
sends Server-Sent Events ``data: {...}`` where each chunk is the full response so far
(cumulative ``text``, ``output_ids`` and ``output_token_logprobs``, as SGLang does without
``--stream-output``); the last chunk carries ``finish_reason``, then ``data: [DONE]``. Chunk
text is detokenized incrementally (`infra.engine.detokenizer`), each chunk's a prefix of the next's;
the last chunk's is the full decode, exactly a non-streamed call's text.

gyre extensions live under ``/gyre/``: ``POST /gyre/kv/export {input_ids}`` answers the KV blob
(``application/octet-stream``), ``POST /gyre/kv/import`` takes one and answers
``{"imported_tokens": n}``.

A server started with an ``api_key`` (a cell's engine bound beyond loopback, SGLang's
``--api-key``) answers 401 to every call but ``GET /health`` that does not carry
``Authorization: Bearer <api_key>``: generation, weight loads, pauses, KV export/import.

Bad input (invalid token ids, too long a context, malformed JSON, bad params) answers 400 with
``{"error": {"message": ..., "type": "BadRequest"}}``; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import threading
import time
from collections import OrderedDict
from typing import Any

import httpx
import numpy as np
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from infra.engine.detokenizer import IncrementalDetokenizer
from infra.engine.engine import Engine
from infra.engine.errors import EngineInputError
from infra.engine.kv_transfer import KVFormatError

log = logging.getLogger(__name__)

VERSION = "gyre-embedded-0.1"


def _dumps(obj: Any) -> bytes:
    # non-finite floats (a -inf logprob) become null, as SGLang's orjson answers have them
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return _dumps(content)


def _error(message: str, status: int = 400) -> JSONResponse:
    kind = "BadRequest" if status == 400 else "InternalError"
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


async def _json_body(request: HTTPRequest) -> dict:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise EngineInputError(f"malformed JSON body: {e}") from e
    if not isinstance(body, dict):
        raise EngineInputError("the JSON body must be an object")
    return body


OPEN_PATHS = frozenset({"/health"})  # what a server with an api key answers to anyone


class RequireKey:
    """ASGI wrapper: every request but `OPEN_PATHS` must carry ``Bearer <api_key>``."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self._want = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self._want):
                body = _dumps({"error": {"message": "missing or wrong api key: send "
                               "'Authorization: Bearer <the run's token>'",
                               "type": "Unauthorized"}})  # fmt: skip
                headers = [(b"content-type", b"application/json"),
                           (b"content-length", str(len(body)).encode())]  # fmt: skip
                await send({"type": "http.response.start", "status": 401, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class PrefixContexts:
    """Input + output ids of the latest finished requests (by rid), so that a caller which
    extends one sends a prefix handle ``{"prefix": {"rid": r, "len": k}}`` plus only the new
    ``input_ids``: the request's ids are then ``context(r)[:k] + input_ids`` (token-exact).
    Bounded by ``max_tokens`` (least recently used first out); an unknown handle answers 409
    ``prefix_unknown`` and the caller re-sends full ids (old-style requests always work)."""

    def __init__(self, max_tokens: int = 1 << 22):
        self._ctx: OrderedDict[str, np.ndarray] = OrderedDict()
        self._tokens = 0
        self._max = max_tokens
        self._lock = threading.Lock()

    def put(self, rid: str, input_ids: Any, output_ids: Any) -> None:
        ctx = np.concatenate(
            [np.asarray(input_ids, dtype=np.int32), np.asarray(output_ids, dtype=np.int32)]
        )
        with self._lock:
            old = self._ctx.pop(rid, None)
            self._tokens += len(ctx) - (0 if old is None else len(old))
            self._ctx[rid] = ctx
            while self._tokens > self._max and len(self._ctx) > 1:
                _, gone = self._ctx.popitem(last=False)
                self._tokens -= len(gone)

    def resolve(self, prefix: Any, input_ids: Any) -> list[int] | None:
        """The full ids of a handle request, or None when the handle is not held."""
        if not isinstance(prefix, dict) or not isinstance(prefix.get("rid"), str):
            raise EngineInputError("prefix must be {rid: str, len: int}")
        k = prefix.get("len")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise EngineInputError("prefix.len must be a non-negative integer")
        with self._lock:
            ctx = self._ctx.get(prefix["rid"])
            if ctx is None or k > len(ctx):
                return None
            self._ctx.move_to_end(prefix["rid"])
        return [*ctx[:k].tolist(), *(input_ids or [])]


def build_app(engine: Engine, api_key: str | None = None) -> Any:
    """The Starlette app serving `engine` (behind `RequireKey` when ``api_key`` is given)."""
    contexts = PrefixContexts()

    async def run_blocking(fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kwargs))

    async def generate(request: HTTPRequest):
        body = await _json_body(request)
        input_ids = body.get("input_ids")
        if input_ids is None and isinstance(body.get("text"), str):
            if engine.tokenizer is None:
                raise EngineInputError("this engine has no tokenizer: send input_ids")
            input_ids = engine.tokenizer.encode(body["text"], add_special_tokens=False)
        if input_ids is not None and input_ids and isinstance(input_ids[0], list):
            raise EngineInputError("batched input_ids are not supported: send one request each")
        if body.get("prefix") is not None:
            input_ids = contexts.resolve(body["prefix"], input_ids)
            if input_ids is None:
                return JSONResponse(
                    {"error": {"message": "prefix handle not held", "code": "prefix_unknown"}},
                    status_code=409,
                )
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()

        stream = bool(body.get("stream", False))

        def listener(req):  # on the engine thread; a plain request only needs the end
            if req.finish_reason is not None and body.get("rid") is not None:
                contexts.put(req.rid, req.input_ids, req.output_ids)
            if stream or req.finish_reason is not None:
                loop.call_soon_threadsafe(updates.put_nowait, req.finish_reason is not None)

        req = engine.submit(
            input_ids,
            body.get("sampling_params") or {},
            rid=body.get("rid"),
            return_logprob=bool(body.get("return_logprob", False)),
            listener=listener,
        )
        if not stream:
            while not req.done.is_set():
                try:
                    await asyncio.wait_for(updates.get(), timeout=1.0)
                except TimeoutError:
                    if await request.is_disconnected():  # nobody will read the answer
                        engine.cancel(req, "client disconnected")
            return JSONResponse(engine.response(req))

        async def events():
            sent = 0
            detok = IncrementalDetokenizer(engine.tokenizer) if engine.tokenizer else None
            try:
                while True:
                    finished = req.done.is_set()
                    n = len(req.output_ids)
                    if finished or n > sent:
                        chunk = engine.response(
                            req, upto=None if finished else n, detokenizer=detok
                        )
                        sent = n
                        yield b"data: " + _dumps(chunk) + b"\n\n"
                    if finished:
                        break
                    await updates.get()
                yield b"data: [DONE]\n\n"
            finally:
                if not req.done.is_set():  # client went away: stop generating for it
                    engine.cancel(req, "client disconnected")

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(request: HTTPRequest):
        return Response(status_code=200)

    async def model_info(request: HTTPRequest):
        return JSONResponse(engine.model_info())

    async def weight_version(request: HTTPRequest):
        return JSONResponse({"weight_version": str(engine.weight_version)})

    async def version(request: HTTPRequest):
        return JSONResponse({"version": VERSION})

    async def server_info(request: HTTPRequest):
        return JSONResponse({**engine.model_info(), "version": VERSION, **engine.load()})

    async def flush_cache(request: HTTPRequest):
        ok = await run_blocking(engine.flush_cache)
        return JSONResponse({"success": ok, "message": "cache flushed"})

    async def abort_request(request: HTTPRequest):
        body = await _json_body(request)
        rid = body.get("rid") or ""
        if not isinstance(rid, str):
            raise EngineInputError("rid must be a string")
        n = engine.abort(rid, abort_all=bool(body.get("abort_all", False)))
        return JSONResponse({"success": True, "aborted": n})

    async def pause(request: HTTPRequest):
        body = await _json_body(request)
        mode = body.get("mode", "abort")
        await run_blocking(engine.pause_generation, mode)
        return JSONResponse({"success": True, "message": f"paused ({mode})"})

    async def resume(request: HTTPRequest):
        await run_blocking(engine.continue_generation)
        return JSONResponse({"success": True, "message": "generation continues"})

    async def update_weights(request: HTTPRequest):
        body = await _json_body(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise EngineInputError("model_path (a checkpoint directory) is required")
        result = await run_blocking(
            engine.update_weights_from_disk,
            path,
            body.get("weight_version"),
            abort_all_requests=bool(body.get("abort_all_requests", False)),
            flush_cache=bool(body.get("flush_cache", True)),
        )
        return JSONResponse(result, status_code=200 if result["success"] else 400)

    async def kv_export(request: HTTPRequest):
        body = await _json_body(request)
        blob = await run_blocking(engine.export_kv, body.get("input_ids"))
        return Response(blob, media_type="application/octet-stream")

    async def kv_import(request: HTTPRequest):
        blob = await request.body()
        n = await run_blocking(engine.import_kv, blob)
        return JSONResponse({"imported_tokens": n})

    async def bad_request(request: HTTPRequest, exc: Exception):
        return _error(str(exc), 400)

    async def internal(request: HTTPRequest, exc: Exception):
        log.exception("engine server error on %s", request.url.path, exc_info=exc)
        return _error(f"{type(exc).__name__}: {exc}", 500)

    routes = [
        Route("/generate", generate, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/get_weight_version", weight_version, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["POST", "GET"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/pause_generation", pause, methods=["POST"]),
        Route("/continue_generation", resume, methods=["POST"]),
        Route("/update_weights_from_disk", update_weights, methods=["POST"]),
        Route("/gyre/kv/export", kv_export, methods=["POST"]),
        Route("/gyre/kv/import", kv_import, methods=["POST"]),
    ]
    handlers = {EngineInputError: bad_request, KVFormatError: bad_request, Exception: internal}
    app = Starlette(routes=routes, exception_handlers=handlers)
    return RequireKey(app, api_key) if api_key else app


class EngineServer:
    """Serve `engine` over HTTP from a background thread (``api_key``: see the module doc)."""

    def __init__(
        self, engine: Engine, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None
    ):
        self.engine = engine
        self.api_key = api_key
        self.host = host
        self.port = port
        self.url: str | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 30.0) -> str:
        """Start serving; return the base URL once /health answers."""
        # proto=IPPROTO_TCP: asyncio turns Nagle off (TCP_NODELAY) on accepted connections only
        # for such sockets; without it every response stalled ~40 ms on delayed ACKs (uvloop
        # sets TCP_NODELAY itself; the explicit protocol keeps the fix whatever the loop)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(  # uvicorn's fast stack: httptools parser, uvloop loop
            build_app(self.engine, self.api_key),
            http="httptools",
            loop="uvloop",
            ws="none",
            log_config=None,  # leave the cell's logging as it is (infra/gateway/server.py)
            log_level="warning",
            access_log=False,
            lifespan="off",
            server_header=False,
            date_header=False,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True, name="engine-http"
        )
        self._thread.start()
        self.url = f"http://{self.host}:{self.port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            if not self._thread.is_alive():
                break
            time.sleep(0.05)
        raise RuntimeError(f"engine server on {self.url} did not become healthy in {timeout}s")

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = self._thread = None

    def __enter__(self) -> EngineServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    """``python -m infra.engine.server --model-path DIR --port N``: SGLang's launch flags.

    SGLang-only flags (``--tp-size``, HiCache, ...) are accepted and ignored, so the SGLang
    adapter can launch the embedded engine as a process with the same command line.
    """
    import argparse
    import signal

    parser = argparse.ArgumentParser(prog="python -m infra.engine.server")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--weight-version", type=int, default=0)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--kv-cache-tokens", type=int, default=262144)
    parser.add_argument("--cell-id", default="local")
    parser.add_argument("--api-key", default=None)
    args, ignored = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO)
    if ignored:
        log.info("ignoring SGLang-only flags: %s", " ".join(ignored))
    engine = Engine(
        args.model_path,
        weight_version=args.weight_version,
        max_batch_size=args.max_batch_size,
        kv_cache_tokens=args.kv_cache_tokens,
        cell_id=args.cell_id,
    )
    server = EngineServer(engine, host=args.host, port=args.port, api_key=args.api_key)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("serving %s at %s", args.model_path, server.start())
    stop.wait()
    server.stop()
    engine.close()


if __name__ == "__main__":
    main()
