"""HTTP endpoints of the gateway: thin adapters over the call pipeline, as a raw ASGI app.

Each handler authenticates the session (``Authorization: Bearer <key>``), parses and validates
the body (`infra.gateway.wire`: a bad request answers 4xx in OpenAI's error shape and stores
nothing; a chat body that extends the session's last one is parsed from where that one ended,
`infra.gateway.chat_body`), opens the call and runs it through `CallPipeline` (which records the TITO call
before it returns), then answers: a JSON body, or an SSE stream through the one pump
(`infra.gateway.stream`).

Raw ASGI rather than a framework's router: the hot endpoints are a dict lookup away from
uvicorn, with no per-call request/response objects beyond what the answer needs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from infra.gateway.chat import (
    ChatInput,
    ChatInputError,
    SessionCalls,
    build_chat_input,
    build_token_input,
    extend_chat_input,
    normalize_messages,
    template_messages,
    tools_key,
)
from infra.gateway.chat_body import Arriving, TailBody, body_memo, parse_tail
from infra.gateway.pipeline import OFFLOAD_BYTES
from infra.gateway.replies import (
    chat_body,
    chat_logprobs,
    completion_body,
    completion_logprobs,
    usage,
)
from infra.gateway.responses import (
    ResponsesRequest,
    ResponsesStream,
    conversation,
    remember,
    response_body,
)
from infra.gateway.stream import (
    ChatStream,
    CompletionStream,
    NativeStream,
    final_native,
    pump,
)
from infra.gateway.wire import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    JsonObject,
    ScoreItem,
    ScoresRequest,
    SessionRequest,
    bad,
    check_token_ids,
    dumps,
    parse_body,
    validate,
)

if TYPE_CHECKING:
    from infra.gateway.core import GatewayCore
    from infra.gateway.pipeline import GenResult
    from infra.gateway.sessions import Session

log = logging.getLogger(__name__)

_JSON = [(b"content-type", b"application/json")]
_RESPONSE = "/v1/responses/"  # GET /v1/responses/{id}
Send = Callable[[dict], Awaitable[None]]
T = TypeVar("T")


class Request:
    """What a handler reads of an ASGI request: headers by name, the body with a size cap."""

    __slots__ = ("_headers", "receive", "scope")

    def __init__(self, scope: dict, receive):
        self.scope = scope
        self.receive = receive
        self._headers: dict[bytes, bytes] | None = None

    def header(self, name: bytes) -> str | None:
        if self._headers is None:
            self._headers = dict(self.scope["headers"])
        v = self._headers.get(name)
        return v.decode("latin-1") if v is not None else None

    async def body(self, limit: int) -> bytes:
        n = self.header(b"content-length")
        if n is not None and n.isdigit() and int(n) > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
        msg = await self.receive()
        body = msg.get("body", b"")
        if not msg.get("more_body"):
            return body
        parts = [body]
        await self._more(msg, limit, len(body), parts.append)
        return b"".join(parts)

    async def body_into(self, limit: int, sink: Arriving) -> Arriving:
        """The body fed part by part to ``sink`` (a chat body compared with the session's
        last one as it arrives: no whole copy of it is made, `infra.gateway.chat_body`)."""
        n = self.header(b"content-length")
        if n is not None and n.isdigit() and int(n) > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
        msg = await self.receive()
        body = msg.get("body", b"")
        sink.feed(body)
        if msg.get("more_body"):
            await self._more(msg, limit, len(body), sink.feed)
        return sink

    async def _more(self, msg: dict, limit: int, size: int, put: Callable[[bytes], Any]) -> None:
        while msg.get("more_body"):
            msg = await self.receive()
            if msg["type"] == "http.disconnect":
                raise ApiError(400, "the client went away mid-body")
            part = msg.get("body", b"")
            size += len(part)
            if size > limit:
                raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
            put(part)

    def bearer(self) -> str | None:
        auth = self.header(b"authorization") or ""
        if auth[:7].lower() == "bearer ":
            return auth[7:].strip() or None
        return self.header(b"x-api-key") or None


async def off_loop(size: int, fn: Callable[..., T], *args) -> T:
    """``fn(*args)``, on a worker thread when the request is large (``size`` bytes), so that
    its CPU work never holds up the event loop (every other session, ``/health``)."""
    if size >= OFFLOAD_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def token_input(tok, prompt: str | list[int] | None, param: str):
    """The ``build`` of a call whose harness sent token ids or a text (completions,
    generate): a text is tokenized there (off the loop when large, refused from its length
    when it cannot fit), ids are checked against the vocabulary once they could fit."""

    def build(calls: SessionCalls, limit: int | None) -> ChatInput:
        if isinstance(prompt, str) and prompt:
            ids = tok.encode(prompt, limit=limit)
        else:
            ids = prompt
            if limit and ids and len(ids) >= limit:  # the budget's 400, before the vocab scan
                raise ChatInputError(
                    f"This model's maximum context length is {limit} tokens; the input has "
                    f"{len(ids)}.",
                    code="context_length_exceeded",
                )
        return build_token_input(calls, check_token_ids(ids, tok.vocab_size, param))

    return build


async def send_json(send: Send, obj: Any, status: int = 200, res: GenResult | None = None) -> None:
    body = dumps(obj)
    headers = [*_JSON, (b"content-length", str(len(body)).encode())]
    if res is not None:  # engine round trip as the gateway saw it (bench/gateway.py)
        headers.append((b"x-gyre-engine-ms", f"{1e3 * (res.t_end - res.t_start):.3f}".encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class GatewayApp:
    """The gateway's ASGI app: routes by path, answers errors in OpenAI's shape."""

    def __init__(self, gw: GatewayCore):
        self.gw = gw
        self.routes: dict[str, tuple[str, Callable[[Request, Send], Awaitable[None]]]] = {
            "/v1/chat/completions": ("POST", self.chat),
            "/v1/completions": ("POST", self.completions),
            "/generate": ("POST", self.generate),
            "/v1/responses": ("POST", self.responses),
            "/v1/models": ("GET", self.models),
            "/gyre/scores": ("POST", self.scores),
            "/gyre/sessions": ("POST", self.admin_sessions),
            "/gyre/stats": ("GET", self.stats),
            "/health": ("GET", self.health),
        }

    async def __call__(self, scope: dict, receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        route = self.routes.get(path)
        if route is None and path.startswith(_RESPONSE) and "/" not in path[len(_RESPONSE) :]:
            route = ("GET", self.get_response)
        try:
            if route is None or route[0] != scope["method"]:
                status = 404 if route is None else 405
                raise ApiError(status, f"{scope['method']} {scope['path']}: not found")
            await route[1](Request(scope, receive), send)
        except ApiError as exc:
            self.gw.counters["errors"] += 1
            await send_json(send, exc.body(), exc.status)
        except Exception as exc:  # a bug: answer in the error shape, keep serving
            log.exception("%s %s failed", scope["method"], scope["path"])
            self.gw.counters["errors"] += 1
            err = ApiError(500, f"internal error: {type(exc).__name__}", type="internal_error")
            await send_json(send, err.body(), 500)

    # -- auth and shared checks ----------------------------------------------------------
    def session_of(self, req: Request) -> Session:
        key = req.bearer()
        if key is None:
            raise ApiError(
                401,
                "missing API key: send 'Authorization: Bearer <session key>'",
                code="invalid_api_key",
            )
        s = self.gw.sessions.by_key(key)
        if s is None:
            raise ApiError(401, "invalid API key (no such session)", code="invalid_api_key")
        return s

    def require_admin(self, req: Request) -> None:
        if self.gw.admin_token is None:
            raise ApiError(
                403,
                "admin endpoints are disabled (no admin token configured)",
                type="permission_error",
            )
        if req.bearer() != self.gw.admin_token:
            raise ApiError(401, "admin token required", code="invalid_api_key")

    def check_model(self, model: str) -> str:
        if model not in self.gw.model_names:
            raise ApiError(
                404,
                f"The model '{model}' does not exist (served: {self.gw.model_name})",
                param="model",
                code="model_not_found",
            )
        return model

    def token_strs(self, ids: list[int]) -> list[str]:
        return [self.gw.tok.token_str(t) for t in ids]

    # -- calls ---------------------------------------------------------------------------
    async def chat(self, req: Request, send: Send) -> None:
        gw = self.gw
        s = self.session_of(req)
        memo = gw.session_calls(s).body_memo
        got = await req.body_into(gw.max_body_bytes, Arriving(memo))
        size = got.size

        def parse():
            # only what is new since the session's last chat body, when it extends that one
            tail = parse_tail(got, memo)
            body = tail.request if tail is not None else parse_body(ChatRequest, got.whole())
            return tail, body, template_messages(body.messages)

        # off the loop when much is to be parsed: the bytes past the memo's end, or them all
        tail, body, messages = await off_loop(size - got.matched if got.extends else size, parse)
        model = self.check_model(body.model)
        gp = body.gen_params()
        tools, tok = body.tools, gw.tok
        whole: list[ChatRequest] = []  # the whole body, when the new messages were not enough

        def keep_memo(calls: SessionCalls, inp: ChatInput, fast: TailBody | None) -> None:
            if tok.message_local:
                head = fast.memo.head if fast is not None else messages[0]
                req_of = whole[0] if whole else body
                raw = got.whole() if fast is None else None  # a tail's memo needs no join
                calls.body_memo = body_memo(raw, req_of, head, tools_key(tools), inp.msg_key, fast)

        tried: list[bool] = []  # the new messages alone were tried (and were not enough)

        def extend(calls: SessionCalls, limit: int | None) -> ChatInput | None:
            """The input from the new messages alone: O(new), whatever the context."""
            tried.append(True)
            m = tail.memo
            inp = extend_chat_input(tok, calls, m.head, tail.t, messages, tools, m.msg_key, limit)
            if inp is not None:
                calls.chain_memo.state = None  # its messages: not kept twice
                keep_memo(calls, inp, tail)
            return inp

        def build(calls: SessionCalls, limit: int | None) -> ChatInput:
            nonlocal messages
            if tail is not None:
                inp = extend(calls, limit) if not tried else None
                if inp is not None:
                    return inp
                whole.append(parse_body(ChatRequest, got.whole()))
                messages = template_messages(whole[0].messages)
            inp = build_chat_input(tok, calls, messages, tools, limit)
            keep_memo(calls, inp, None)
            return inp

        # new messages of a small tail are built on the loop (a thread hop costs more than
        # them); the whole conversation, when they are not enough, as the session's size says
        light = extend if tail is not None and len(tail.tail) < OFFLOAD_BYTES else None
        call = await gw.pipeline.open(
            s,
            "chat",
            build,
            gp=gp,
            param="messages",
            parse_tools=body.parse_tools,
            size=size,
            light=light,
        )
        after, at = call.inp.after, call.inp.after_at
        gw.counters["chat_tail_parses"] += tail is not None and not whole
        if whole:
            call.request_json = whole[0].request_json(after, at)
        else:
            call.request_json = body.request_json(after, at, tail.t if tail is not None else 0)
        if gp.stream:
            return await pump(gw, call, ChatStream(tok, call, model), send, req.receive)
        a = await gw.pipeline.run(call)
        r = a.res
        lp = chat_logprobs(self.token_strs(r.output_ids), r.logprobs) if gp.logprobs else None
        use = usage(call.n_in, len(r.output_ids), r.cached_tokens)
        answer = chat_body(
            call.rid, model, a.content, a.tool_calls, a.finish_reason, use, lp, call.created
        )
        await send_json(send, answer, res=r)

    async def completions(self, req: Request, send: Send) -> None:
        gw = self.gw
        s = self.session_of(req)
        raw = await req.body(gw.max_body_bytes)
        body = await off_loop(len(raw), parse_body, CompletionRequest, raw)
        model = self.check_model(body.model)
        gp = body.gen_params()
        prompt = body.one_prompt()
        build = token_input(gw.tok, prompt, "prompt")
        call = await gw.pipeline.open(s, "completions", build, gp=gp, param="prompt", size=len(raw))
        if gp.stream:
            return await pump(gw, call, CompletionStream(gw.tok, call, model), send, req.receive)
        a = await gw.pipeline.run(call)
        r = a.res
        lp = completion_logprobs(self.token_strs(r.output_ids), r.logprobs) if gp.logprobs else None
        use = usage(call.n_in, len(r.output_ids), r.cached_tokens)
        answer = completion_body(call.rid, model, a.text, a.finish_reason, use, lp, call.created)
        await send_json(send, answer, res=r)

    async def generate(self, req: Request, send: Send) -> None:
        gw = self.gw
        s = self.session_of(req)
        raw = await req.body(gw.max_body_bytes)
        body = await off_loop(len(raw), parse_body, GenerateRequest, raw)
        gp = body.gen_params()
        prompt = body.input_ids if body.input_ids is not None else body.text
        build = token_input(gw.tok, prompt, "input_ids")
        call = await gw.pipeline.open(s, "generate", build, gp=gp, param="input_ids", size=len(raw))
        view = NativeStream(gw.tok, call)
        if gp.stream:
            return await pump(gw, call, view, send, req.receive)
        a = await gw.pipeline.run(call)
        await send_json(send, final_native(view, a), res=a.res)

    async def responses(self, req: Request, send: Send) -> None:
        gw = self.gw
        s = self.session_of(req)
        raw = await req.body(gw.max_body_bytes)
        body = await off_loop(len(raw), parse_body, ResponsesRequest, raw)
        self.check_model(body.model)
        gp = body.gen_params()
        tools, tok = body.chat_tools, gw.tok
        gw.session_calls(s)  # after a restart, this also restores the session's responses
        messages, own = conversation(s, body)
        try:
            messages = normalize_messages(messages)
        except ChatInputError as exc:
            raise bad(str(exc), "input") from exc
        call = await gw.pipeline.open(
            s,
            "responses",
            lambda calls, limit: build_chat_input(tok, calls, messages, tools, limit),
            gp=gp,
            param="input",
            parse_tools=body.parse_tools,
            size=len(raw),
        )
        call.request_json = body.request_json()
        call.render = lambda a: response_body(call, body, a)  # recorded with the call
        if gp.stream:
            view = ResponsesStream(tok, call, body, lambda a: remember(s, call, body, own, a))
            return await pump(gw, call, view, send, req.receive)
        a = await gw.pipeline.run(call)
        remember(s, call, body, own, a)
        await send_json(send, a.body, res=a.res)

    async def get_response(self, req: Request, send: Send) -> None:
        """``GET /v1/responses/{id}``: a response of the caller's session, as it was answered
        (after a restart too: it is read back from the TITO record)."""
        s = self.session_of(req)
        rid = req.scope["path"][len(_RESPONSE) :]
        self.gw.session_calls(s)  # after a restart, this also restores the session's responses
        got = s.responses.get(rid)
        if got is None:
            raise ApiError(404, f"Response with id {rid!r} not found.", param="response_id")
        await send_json(send, got[2])

    # -- models, scores, admin, stats ----------------------------------------------------
    async def models(self, req: Request, send: Send) -> None:
        self.session_of(req)
        gw = self.gw
        data = [
            {
                "id": gw.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "gyre",
                "max_model_len": gw.max_context(),
            }
        ]
        await send_json(send, {"object": "list", "data": data})

    async def scores(self, req: Request, send: Send) -> None:
        gw = self.gw
        s = self.session_of(req)
        data = parse_body(JsonObject, await req.body(gw.max_body_bytes)).root
        items = (
            validate(ScoresRequest, data).scores
            if "scores" in data
            else [validate(ScoreItem, data)]
        )
        rows = [self.score_row(s, it) for it in items]
        await asyncio.to_thread(gw.store.append, "scores", rows)
        await send_json(send, {"ok": True, "session_id": s.session_id, "n": len(rows)})

    def score_row(self, s: Session, it: ScoreItem) -> dict:
        gw = self.gw
        at = it.at_request_id
        if at is not None and at not in gw.session_calls(s).calls:
            raise bad("'at_request_id' is not a call of this session", "at_request_id")
        return {
            "run_id": gw.run_id,
            "session_id": s.session_id,
            "subtask_id": it.subtask_id,
            "score": float(it.score),
            "weight": float(it.weight),
            "at_request_id": at if at is not None else s.last_request_id,
            "source": it.source or "harness",
            "status": it.status or "finished",
            "reason": it.reason or "",
        }

    async def admin_sessions(self, req: Request, send: Send) -> None:
        self.require_admin(req)
        raw = await req.body(self.gw.max_body_bytes)
        body = parse_body(SessionRequest, raw or b"{}")
        try:
            sid, key = self.gw.new_session(body.session_id, group_id=body.group_id, meta=body.meta)
        except ValueError as exc:
            status = 409 if "exists" in str(exc) else 400
            raise ApiError(status, str(exc), param="session_id") from exc
        await send_json(send, {"session_id": sid, "api_key": key})

    async def stats(self, req: Request, send: Send) -> None:
        if self.gw.admin_token is not None:
            self.require_admin(req)
        await send_json(send, self.gw.stats())

    async def health(self, req: Request, send: Send) -> None:
        await send_json(send, {"ok": True, "engines": len(self.gw.router.active())})
