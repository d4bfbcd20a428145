"""HTTP endpoints of the gateway (Starlette): OpenAI-compatible, SGLang-native, gyre admin.

Every handler authenticates the session first (``Authorization: Bearer <key>``), validates the
whole request before any engine work (so a bad request answers 4xx and stores nothing), runs
the call through `Gateway.generate`, appends the TITO record, and only then answers (for a
stream: the final chunk goes out after the record is durable).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from infra.gateway.chat import (
    ChatInputError,
    build_chat_input,
    build_token_input,
    normalize_messages,
    parse_output,
    reply_key,
)
from infra.gateway.wire import (
    SSE_DONE,
    ApiError,
    JSONDecodeError,
    bad,
    chat_body,
    chat_chunk,
    chat_logprobs,
    check_token_ids,
    completion_body,
    completion_logprobs,
    dumps,
    loads,
    parse_native_params,
    parse_openai_params,
    sse,
    usage,
    usage_chunk,
)

if TYPE_CHECKING:
    from infra.gateway.gateway import Gateway, GenResult
    from infra.gateway.sessions import Session

_JSON = "application/json"


def _json(obj: Any, status: int = 200, res: GenResult | None = None) -> Response:
    headers = None
    if res is not None:  # engine round trip as the gateway saw it (bench/gateway.py)
        headers = {"x-gyre-engine-ms": f"{1e3 * (res.t_end - res.t_start):.3f}"}
    return Response(dumps(obj), status_code=status, media_type=_JSON, headers=headers)


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization") or ""
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.headers.get("x-api-key") or None


def build_app(gw: Gateway) -> Starlette:
    tok = gw.tok

    def session_of(request: Request) -> Session:
        key = _bearer(request)
        if key is None:
            raise ApiError(
                401,
                "missing API key: send 'Authorization: Bearer <session key>'",
                code="invalid_api_key",
            )
        s = gw.sessions.by_key(key)
        if s is None:
            raise ApiError(401, "invalid API key (no such session)", code="invalid_api_key")
        return s

    def require_admin(request: Request) -> None:
        if gw.admin_token is None:
            raise ApiError(
                403,
                "admin endpoints are disabled (no admin token configured)",
                type="permission_error",
            )
        if _bearer(request) != gw.admin_token:
            raise ApiError(401, "admin token required", code="invalid_api_key")

    async def body_of(request: Request) -> dict:
        n = request.headers.get("content-length")
        if n is not None and n.isdigit() and int(n) > gw.max_body_bytes:
            raise ApiError(
                413, f"request body over {gw.max_body_bytes} bytes", code="body_too_large"
            )
        chunks, size = [], 0
        async for c in request.stream():
            size += len(c)
            if size > gw.max_body_bytes:
                raise ApiError(
                    413, f"request body over {gw.max_body_bytes} bytes", code="body_too_large"
                )
            chunks.append(c)
        try:
            body = loads(b"".join(chunks))
        except (JSONDecodeError, ValueError) as exc:
            raise bad(f"malformed JSON body: {exc}", code="invalid_json") from exc
        if not isinstance(body, dict):
            raise bad("the JSON body must be an object", code="invalid_json")
        return body

    def check_model(body: dict) -> str:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad("'model' is required", "model")
        if model not in gw.model_names:
            raise ApiError(
                404,
                f"The model '{model}' does not exist (served: {gw.model_name})",
                param="model",
                code="model_not_found",
            )
        return model

    def token_strs(ids: list[int]) -> list[str]:
        return [tok.token_str(t) for t in ids]

    # -- chat ----------------------------------------------------------------------------
    async def chat_completions(request: Request) -> Response:
        s = session_of(request)
        body = await body_of(request)
        model = check_model(body)
        gp = parse_openai_params(body, chat=True)
        tools = body.get("tools") or None
        if tools is not None and not (
            isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
        ):
            raise bad("'tools' must be a list of objects", "tools")
        parse_tools = bool(tools) and body.get("tool_choice") != "none"
        try:
            messages = normalize_messages(body.get("messages"))
            inp = await gw.prepare(s, lambda calls: build_chat_input(tok, calls, messages, tools))
        except ChatInputError as exc:
            raise bad(str(exc), "messages") from exc
        max_new = gw.budget(len(inp.input_ids), gp)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        seq = s.next_seq()
        ids = inp.input_ids.tolist()

        def finish(res: GenResult) -> tuple[str | None, list[dict], str]:
            text, _ = gw.trim_stop(res, gp.stop)
            content, calls = parse_output(text) if parse_tools else (text, [])
            reason = (
                "tool_calls" if calls else ("length" if res.finish_type == "length" else "stop")
            )
            return content, calls, reason

        if not gp.stream:
            res = await gw.generate(s, rid, ids, gp, max_new)
            try:
                content, calls, reason = finish(res)
                await gw.record(s, rid, seq, inp, res, "chat", reply_key(content, calls))
            finally:
                gw.settle(res)
            lp = chat_logprobs(token_strs(res.output_ids), res.logprobs) if gp.logprobs else None
            use = usage(len(ids), len(res.output_ids), res.cached_tokens)
            return _json(chat_body(rid, model, content, calls, reason, use, lp), res=res)

        created = int(time.time())
        hold = max((len(x) for x in gp.stop), default=1) - 1

        def visible(text: str) -> str:
            if parse_tools:
                i = text.find("<tool_call>")
                if i >= 0:
                    text = text[:i]
                text = text.rstrip()
            if gp.stop:
                i = _first_stop(text, gp.stop)
                text = text[:i] if i is not None else text[: max(0, len(text) - hold)]
            return text.rstrip("\ufffd")

        async def events():
            q: asyncio.Queue = asyncio.Queue()
            sent = {"text": "", "lp": 0}

            async def on_tokens(out, lps):
                q.put_nowait((out, lps))

            task = asyncio.create_task(gw.generate(s, rid, ids, gp, max_new, on_tokens))
            yield sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
            try:
                while True:
                    get = asyncio.ensure_future(q.get())
                    done, _ = await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                    if get not in done:
                        get.cancel()
                        while not q.empty():  # drain what came with the end
                            q.get_nowait()
                        break
                    out, lps = get.result()
                    text = visible(tok.decode(out))
                    delta = text[len(sent["text"]) :] if text.startswith(sent["text"]) else ""
                    lp = None
                    if gp.logprobs and len(out) > sent["lp"]:
                        lp = chat_logprobs(token_strs(out[sent["lp"] :]), lps[sent["lp"] :])
                        sent["lp"] = len(out)
                    if delta or lp:
                        sent["text"] += delta
                        yield sse(chat_chunk(rid, model, created, {"content": delta}, None, lp))
                res = task.result()
                content, calls, reason = finish(res)
                rest = (
                    (content or "")[len(sent["text"]) :]
                    if (content or "").startswith(sent["text"])
                    else ""
                )
                lp = None
                if gp.logprobs and len(res.output_ids) > sent["lp"]:
                    lp = chat_logprobs(
                        token_strs(res.output_ids[sent["lp"] :]), res.logprobs[sent["lp"] :]
                    )
                if rest or lp:
                    yield sse(chat_chunk(rid, model, created, {"content": rest}, None, lp))
                if calls:
                    tc = [{"index": i, **c} for i, c in enumerate(calls)]
                    yield sse(chat_chunk(rid, model, created, {"tool_calls": tc}))
                await gw.record(s, rid, seq, inp, res, "chat", reply_key(content, calls))
                yield sse(chat_chunk(rid, model, created, {}, reason))
                if gp.include_usage:
                    use = usage(len(ids), len(res.output_ids), res.cached_tokens)
                    yield sse(usage_chunk(rid, model, created, use))
                yield SSE_DONE
            except ApiError as exc:
                gw.counters["errors"] += 1
                yield sse(exc.body())
                yield SSE_DONE
            finally:
                _end_stream(gw, task)

        return StreamingResponse(events(), media_type="text/event-stream")

    # -- text completions ----------------------------------------------------------------
    async def completions(request: Request) -> Response:
        s = session_of(request)
        body = await body_of(request)
        model = check_model(body)
        gp = parse_openai_params(body, chat=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise bad("'prompt' must not be empty", "prompt")
            ids = tok.encode(prompt)
        else:
            ids = check_token_ids(prompt, tok.vocab_size, "prompt")
        inp = await gw.prepare(s, build_token_input, ids)
        max_new = gw.budget(len(ids), gp, "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        seq = s.next_seq()
        ids = inp.input_ids.tolist()
        if not gp.stream:
            res = await gw.generate(s, rid, ids, gp, max_new)
            try:
                text, _ = gw.trim_stop(res, gp.stop)
                await gw.record(s, rid, seq, inp, res, "completions")
            finally:
                gw.settle(res)
            lp = (
                completion_logprobs(token_strs(res.output_ids), res.logprobs)
                if gp.logprobs
                else None
            )
            use = usage(len(ids), len(res.output_ids), res.cached_tokens)
            return _json(completion_body(rid, model, text, _reason(res), use, lp), res=res)

        created = int(time.time())

        async def events():
            sent = {"text": ""}

            async def on_tokens(out, lps):
                text = tok.decode(out).rstrip("\ufffd")
                if gp.stop:
                    i = _first_stop(text, gp.stop)
                    hold = max(len(x) for x in gp.stop) - 1
                    text = text[:i] if i is not None else text[: max(0, len(text) - hold)]
                if text.startswith(sent["text"]) and len(text) > len(sent["text"]):
                    q.put_nowait(text[len(sent["text"]) :])
                    sent["text"] = text

            q: asyncio.Queue = asyncio.Queue()
            task = asyncio.create_task(gw.generate(s, rid, ids, gp, max_new, on_tokens))
            try:
                while True:
                    get = asyncio.ensure_future(q.get())
                    done, _ = await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                    if get in done:
                        yield sse(
                            completion_body(rid, model, get.result(), None, None, None, created)
                        )
                        continue
                    get.cancel()
                    break
                while not q.empty():
                    yield sse(
                        completion_body(rid, model, q.get_nowait(), None, None, None, created)
                    )
                res = task.result()
                text, _ = gw.trim_stop(res, gp.stop)
                rest = text[len(sent["text"]) :] if text.startswith(sent["text"]) else ""
                await gw.record(s, rid, seq, inp, res, "completions")
                yield sse(completion_body(rid, model, rest, _reason(res), None, None, created))
                if gp.include_usage:
                    use = usage(len(ids), len(res.output_ids), res.cached_tokens)
                    yield sse(usage_chunk(rid, model, created, use, chat=False))
                yield SSE_DONE
            except ApiError as exc:
                gw.counters["errors"] += 1
                yield sse(exc.body())
                yield SSE_DONE
            finally:
                _end_stream(gw, task)

        return StreamingResponse(events(), media_type="text/event-stream")

    # -- SGLang-native generate ----------------------------------------------------------
    async def generate(request: Request) -> Response:
        s = session_of(request)
        body = await body_of(request)
        gp = parse_native_params(body)
        ids = body.get("input_ids")
        if ids is None and isinstance(body.get("text"), str) and body["text"]:
            ids = tok.encode(body["text"])
        ids = check_token_ids(ids, tok.vocab_size, "input_ids")
        inp = await gw.prepare(s, build_token_input, ids)
        max_new = gw.budget(len(ids), gp, "input_ids")
        rid = f"gen-{uuid.uuid4().hex}"
        seq = s.next_seq()
        ids = inp.input_ids.tolist()

        def native(res: GenResult, text: str, finished: bool) -> dict:
            meta = {
                "id": rid,
                "finish_reason": res.finish if finished else None,
                "prompt_tokens": len(ids),
                "completion_tokens": len(res.output_ids),
                "cached_tokens": res.cached_tokens,
                "weight_version": str(res.weight_version),
                "cell_id": res.cell_id,
            }
            if gp.logprobs:
                meta["output_token_logprobs"] = [
                    [lp, t, None] for lp, t in zip(res.logprobs, res.output_ids, strict=True)
                ]
            return {"text": text, "output_ids": res.output_ids, "meta_info": meta}

        if not gp.stream:
            res = await gw.generate(s, rid, ids, gp, max_new)
            try:
                text, _ = gw.trim_stop(res, gp.stop)
                await gw.record(s, rid, seq, inp, res, "generate")
            finally:
                gw.settle(res)
            return _json(native(res, text, True), res=res)

        async def events():
            from infra.gateway.gateway import GenResult

            q: asyncio.Queue = asyncio.Queue()

            async def on_tokens(out, lps):
                q.put_nowait((out, lps))

            task = asyncio.create_task(gw.generate(s, rid, ids, gp, max_new, on_tokens))
            try:
                while True:
                    get = asyncio.ensure_future(q.get())
                    done, _ = await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                    if get not in done:
                        get.cancel()
                        break
                    out, lps = get.result()
                    part = GenResult(out, lps, {}, -1, 0, "", 0.0, 0.0)
                    yield sse(native(part, tok.decode(out), False))
                res = task.result()
                text, _ = gw.trim_stop(res, gp.stop)
                await gw.record(s, rid, seq, inp, res, "generate")
                yield sse(native(res, text, True))
                yield SSE_DONE
            except ApiError as exc:
                gw.counters["errors"] += 1
                yield sse(exc.body())
                yield SSE_DONE
            finally:
                _end_stream(gw, task)

        return StreamingResponse(events(), media_type="text/event-stream")

    # -- models, scores, admin, stats ----------------------------------------------------
    async def models(request: Request) -> Response:
        session_of(request)
        data = [
            {
                "id": gw.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "gyre",
                "max_model_len": gw.max_context(),
            }
        ]
        return _json({"object": "list", "data": data})

    async def scores(request: Request) -> Response:
        s = session_of(request)
        body = await body_of(request)
        items = body.get("scores") if isinstance(body.get("scores"), list) else [body]
        rows = [score_row(s, it) for it in items]
        await asyncio.to_thread(gw.store.append, "scores", rows)
        return _json({"ok": True, "session_id": s.session_id, "n": len(rows)})

    def score_row(s: Session, it: Any) -> dict:
        if not isinstance(it, dict):
            raise bad("each score must be an object")
        sub = it.get("subtask_id")
        if not isinstance(sub, str) or not sub:
            raise bad("'subtask_id' (a non-empty string) is required", "subtask_id")
        score = it.get("score")
        if isinstance(score, bool) or not isinstance(score, int | float) or not 0.0 <= score <= 1.0:
            raise bad("'score' must be a number in [0, 1]", "score")
        weight = it.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
            raise bad("'weight' must be a number >= 0", "weight")
        at = it.get("at_request_id")
        if at is not None and (not isinstance(at, str) or at not in gw.session_calls(s).calls):
            raise bad("'at_request_id' is not a call of this session", "at_request_id")
        for k in ("source", "status", "reason"):
            if it.get(k) is not None and not isinstance(it[k], str):
                raise bad(f"'{k}' must be a string", k)
        return {
            "run_id": gw.run_id,
            "session_id": s.session_id,
            "subtask_id": sub,
            "score": float(score),
            "weight": float(weight),
            "at_request_id": at if at is not None else s.last_request_id,
            "source": it.get("source") or "harness",
            "status": it.get("status") or "finished",
            "reason": it.get("reason") or "",
        }

    async def admin_sessions(request: Request) -> Response:
        require_admin(request)
        body = await body_of(request)
        try:
            sid, key = gw.new_session(
                body.get("session_id"),
                group_id=str(body.get("group_id") or ""),
                meta=body.get("meta") if isinstance(body.get("meta"), dict) else None,
            )
        except ValueError as exc:
            raise ApiError(
                409 if "exists" in str(exc) else 400, str(exc), param="session_id"
            ) from exc
        return _json({"session_id": sid, "api_key": key})

    async def stats(request: Request) -> Response:
        if gw.admin_token is not None:
            require_admin(request)
        return _json(gw.stats())

    async def health(request: Request) -> Response:
        return _json({"ok": True, "engines": len(gw.router.active())})

    async def api_error(request: Request, exc: ApiError) -> Response:
        gw.counters["errors"] += 1
        return _json(exc.body(), exc.status)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        return _json(
            ApiError(status, f"{request.method} {request.url.path}: not found").body(), status
        )

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/generate", generate, methods=["POST"]),
        Route("/gyre/scores", scores, methods=["POST"]),
        Route("/gyre/sessions", admin_sessions, methods=["POST"]),
        Route("/gyre/stats", stats, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    return Starlette(
        routes=routes, exception_handlers={ApiError: api_error, 404: not_found, 405: not_found}
    )


def _end_stream(gw: Gateway, task: asyncio.Task) -> None:
    """A stream ended (answered, failed, or the harness hung up): stop its generation if it
    still runs; if it finished, settle it (a harness gone before the record stops counting)."""
    if not task.done():
        task.cancel()
    elif not task.cancelled() and task.exception() is None:
        gw.settle(task.result())


def _first_stop(text: str, stops: list[str]) -> int | None:
    best = None
    for x in stops:
        i = text.find(x)
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def _reason(res: GenResult) -> str:
    return "length" if res.finish_type == "length" else "stop"
