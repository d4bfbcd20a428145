"""The gateway's one call pipeline: prepare -> budget -> generate -> trim stop -> record.

Every endpoint (chat, completions, native ``/generate``, responses; streamed or not) is a thin
adapter over two steps::

    call = await pipeline.open(session, "chat", build_chat_input, tok, messages, tools, gp=gp)
    answer = await pipeline.run(call, on_tokens)   # on_tokens: a stream's cumulative tokens

``open`` builds the token input (token-exact, delta-encoded against the best earlier call) and
checks the context budget: a call it rejects stores nothing and takes no ``seq_no``. ``run``
generates on the session's cell (continuing elsewhere after a withdrawal, an abort or a dead
cell), cuts the output at a stop string, parses tool calls, and appends the TITO record.

Two rules hold by construction, here and nowhere else:

* **record, then answer**: ``run`` returns only once the TITO record is durable (write-ahead
  log, fsynced), and an adapter answers (or sends a stream's final chunk) only with what
  ``run`` returned. ``seq_no`` is taken when the record is written, so calls that fail
  leave no gap.
* **settle**: from the moment the engine's answer is in until its record is written (or has
  failed), the session counts the call as unrecorded; a withdrawal of the cell waits for that,
  since the newest context is the KV to move. One ``try/finally`` in ``run`` owns the count,
  so no path (an engine error, a harness gone mid-stream, a failing record) leaves it behind.
  Once generated, a call is recorded even if its harness hung up (``Call.generated``: the SSE
  pump cancels only calls still generating).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from infra.engine_api.client import EngineError
from infra.gateway.chat import (
    ChatInput,
    ChatInputError,
    ChatTokenizer,
    SessionCalls,
    apply_stop,
    digest,
    parse_output,
    reply_key,
)
from infra.gateway.router import EngineHandle, NoEngineError, Router
from infra.gateway.sessions import Session
from infra.gateway.wire import ApiError, GenParams, bad, dumps
from storage.tito import TitoRecord
from storage.tito_log import TitoLog


class CallState(Protocol):
    """What the call path reads and updates of the gateway's state (`GatewayCore` is it).
    Named here so that the pipeline needs no import of the core (no circle)."""

    run_id: str
    default_max_tokens: int
    engine_wait_s: float
    tok: ChatTokenizer
    tito: TitoLog
    router: Router
    counters: dict[str, int]

    def session_calls(self, s: Session) -> SessionCalls: ...

    def journal_reply(self, session_id: str, rid: str, msg_key: bytes, reply: bytes) -> None: ...

    async def wait_for_engine(self, timeout: float) -> bool: ...

    def max_context(self) -> int | None: ...

    async def cell_for(self, s: Session) -> EngineHandle: ...


log = logging.getLogger(__name__)

MAX_ATTEMPTS = 6  # engine attempts per call (withdrawal, aborts, dead cells)
OFFLOAD_TOKENS = 65_536  # sessions at least this large build inputs off the event loop
OFFLOAD_BYTES = 65_536  # and so do request bodies this large (a ~16K-token text or more)
RID_PREFIX = {"chat": "chatcmpl", "completions": "cmpl", "generate": "gen", "responses": "resp"}
_VERSION_DIGITS = re.compile(r"(-?\d+)\s*$")

OnTokens = Callable[[list[int], list[float]], Any]


def parse_weight_version(v: Any) -> int:
    """SGLang sends the version as a string ("3", "v3", "step-3"); -1 when it has no number."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    m = _VERSION_DIGITS.search(str(v or ""))
    return int(m.group(1)) if m else -1


@dataclass
class GenResult:
    """What the engine(s) generated for one call."""

    output_ids: list[int]
    logprobs: list[float]
    finish: dict  # SGLang finish_reason ({"type": stop|length|abort, ...})
    weight_version: int
    cached_tokens: int
    cell_id: str
    t_start: float
    t_end: float

    @property
    def finish_type(self) -> str:
        return str(self.finish.get("type") or "stop")


@dataclass(eq=False)
class Call:
    """One harness call, validated and token-encoded, not yet generated."""

    session: Session
    endpoint: str  # chat | completions | generate | responses (the TITO ``endpoint``)
    rid: str  # the TITO request_id, and the OpenAI/SGLang ``id`` of the answer
    inp: ChatInput
    gp: GenParams
    max_new: int
    parse_tools: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    generated: bool = False  # the engine's answer is in: from here on the call is recorded
    request_json: str | None = None  # the request as the harness sent it (TITO request_json)
    # the body the harness is answered with, when it is kept with the record (Responses:
    # what GET /v1/responses/{id} and previous_response_id read back, restarts included)
    render: Callable[[Answer], dict] | None = None

    @property
    def n_in(self) -> int:
        return len(self.inp.input_ids)


@dataclass
class Answer:
    """A recorded call: its (stop-trimmed) output and the OpenAI view of it."""

    res: GenResult
    text: str  # decoded output, cut before the stop string
    content: str | None  # text outside tool-call blocks (chat)
    tool_calls: list[dict]
    finish_reason: str  # OpenAI: stop | length | tool_calls
    body: dict | None = None  # ``Call.render``'s body, as recorded (the one to answer with)


class CallPipeline:
    """The call path of one gateway (state lives in `GatewayCore`, a `CallState`)."""

    def __init__(self, gw: CallState):
        self.gw = gw
        self._rid_base = uuid.uuid4().hex[:16]
        self._n = 0

    # -- open: everything that can reject a call, before any engine work ---------------------
    async def open(
        self,
        s: Session,
        endpoint: str,
        build: Callable[[SessionCalls, int | None], ChatInput],
        *,
        gp: GenParams,
        param: str,
        parse_tools: bool = False,
        size: int = 0,
        light: Callable[[SessionCalls, int | None], ChatInput | None] | None = None,
    ) -> Call:
        """Token input and budget of a call, or `ApiError`; nothing is stored or consumed.

        ``build(calls, limit)`` runs under the session's state lock; on a worker thread once
        the session is large or the request is (``size``: its body's bytes): templating,
        hashing and tokenizing a ~1M-token context take from tens of ms to seconds, which
        would otherwise stall every other session, and ``/health``, on the event loop.
        ``limit`` is the engines' context (None before one joined): what cannot fit it is
        refused from its length before it is tokenized (`ContextTooLong`). ``param`` names
        the request field that a rejected input blames. ``light``: a build whose work does not
        grow with the session (a chat call's new messages), tried first on the loop whatever
        the session's size; None from it means ``build`` is needed."""
        calls = self.gw.session_calls(s)
        limit = self.gw.max_context()

        def run() -> ChatInput:
            with s.state_lock:
                return build(calls, limit)

        try:
            inp = None
            if light is not None:
                with s.state_lock:
                    inp = light(calls, limit)
            if inp is None:
                big = s.tokens >= OFFLOAD_TOKENS or size >= OFFLOAD_BYTES
                self.gw.counters["builds_off_loop"] += big
                inp = await asyncio.to_thread(run) if big else run()
        except ChatInputError as exc:
            raise bad(str(exc), exc.param or param, exc.code) from exc
        if not self.gw.router.active():  # the budget needs an engine's limits: wait for one
            await self.gw.wait_for_engine(self.gw.engine_wait_s)
        max_new = self.budget(len(inp.input_ids), gp, param)
        return Call(s, endpoint, self.new_rid(endpoint), inp, gp, max_new, parse_tools)

    def new_rid(self, endpoint: str) -> str:
        """``chatcmpl-<32 hex>``: this process's random half, then a counter (unique across
        restarts, fixed length so that no id is a prefix of another; no urandom per call)."""
        self._n += 1
        return f"{RID_PREFIX[endpoint]}-{self._rid_base}{self._n:016x}"

    def budget(self, n_in: int, gp: GenParams, param: str) -> int:
        """max_new_tokens for a call, or a 400 when the context does not fit the model."""
        gw = self.gw
        if not gw.router.active():
            raise ApiError(
                503,
                f"no rollout engine is available, and none joined within {gw.engine_wait_s:.0f}s",
                type="service_unavailable",
            )
        limit = gw.max_context()
        if limit and n_in >= limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens; the input has {n_in}.",
                param=param,
                code="context_length_exceeded",
            )
        if gp.max_new_tokens is not None:
            if limit and n_in + gp.max_new_tokens > limit:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {limit} tokens; you requested "
                    f"{n_in + gp.max_new_tokens} ({n_in} input + {gp.max_new_tokens} output).",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            return gp.max_new_tokens
        return min(gw.default_max_tokens, limit - n_in) if limit else gw.default_max_tokens

    # -- run: generate, settle, record ---------------------------------------------------------
    async def run(self, call: Call, on_tokens: OnTokens | None = None) -> Answer:
        """Generate, trim, record; returns once the record is durable (see the module doc)."""
        res = await self.generate(call, on_tokens)
        # No await between the engine's answer and here: a withdrawal sees this call in flight
        # on its cell or unrecorded in its session, never neither.
        s = call.session
        call.generated = True
        s.unrecorded += 1
        try:
            answer = self.finish(call, res)
            await self.record(call, answer)
        finally:
            s.unrecorded -= 1
        return answer

    async def generate(self, call: Call, on_tokens: OnTokens | None = None) -> GenResult:
        """Run the call on the session's cell; continue elsewhere on withdrawal/abort/death.

        ``on_tokens(output_ids, logprobs)`` (cumulative) is called per streamed chunk.
        """
        gw, s, rid, gp = self.gw, call.session, call.rid, call.gp
        input_ids = call.inp.input_ids  # int32 array: orjson writes it without a list
        t0 = time.time()
        out: list[int] = []
        lps: list[float] = []
        version: int | None = None
        cached: int | None = None
        handle_ok = True  # cleared when the engine does not hold the handle (409)
        for attempt in range(MAX_ATTEMPTS):
            h = await self.cell_for(s)
            erid = rid if attempt == 0 else f"{rid}-{attempt}"
            sp = gp.sampling_params(call.max_new - len(out))
            ids = np.concatenate([input_ids, np.asarray(out, np.int32)]) if out else input_ids
            h.inflight[erid] = time.time()
            s.inflight += 1
            prefix: tuple[str, int] | None = None
            try:
                client = await gw.router.client(h)
                send, prefix = ids, self._handle(call, h) if handle_ok else None
                if prefix is not None:  # the engine holds the prefix: send only the rest
                    send = ids[prefix[1] :]
                    gw.counters["prefix_handles"] += 1
                elif not h.prefix_handles and not out:  # all the ids, the new ones encoded
                    inp = call.inp  # (no await until the client has joined the body)
                    send = s.ids_json.encode(rid, ids, inp.parent_request_id, inp.prefix_len)
                if on_tokens is None:
                    resp = await client.generate(send, sp, rid=erid, prefix=prefix)
                else:
                    resp = None
                    async for chunk in client.generate_stream(send, sp, rid=erid, prefix=prefix):
                        resp = chunk
                        on_tokens(out + chunk["output_ids"], lps + _lps(chunk))
                    if resp is None:
                        raise EngineError("stream ended without a response", url=h.base_url)
            except EngineError as exc:
                if exc.status == 409 and prefix is not None:  # evicted there: full ids
                    handle_ok = False
                    continue
                h.errors += 1
                if exc.status is not None and 400 <= exc.status < 500:
                    raise ApiError(
                        400, f"the engine rejected the request: {exc.server_message}"
                    ) from exc
                gw.counters["retries"] += 1
                log.warning(
                    "call %s on %s failed (attempt %d): %s", rid, h.cell_id, attempt + 1, exc
                )
                alive = h.client is not None and await h.client.health()
                if not alive:
                    h.state = "dead"  # unreachable: its sessions re-prefill elsewhere
                continue
            finally:
                h.inflight.pop(erid, None)
                s.inflight -= 1
            meta = resp.get("meta_info") or {}
            new = [int(t) for t in resp.get("output_ids") or []]
            if version is None and (new or attempt == MAX_ATTEMPTS - 1):
                version = parse_weight_version(meta.get("weight_version"))
            if cached is None:
                cached = int(meta.get("cached_tokens") or 0)
            got = _lps(resp)[: len(new)]
            out += new
            lps += got + [float("nan")] * (len(new) - len(got))
            h.calls += 1
            h.tokens += len(new)
            finish = meta.get("finish_reason") or {"type": "stop"}
            if finish.get("type") == "abort" and len(out) < call.max_new:
                gw.counters["retries"] += 1  # drained or paused: resubmit prefix + partial
                continue
            v = version if version is not None else -1
            self._held(s, rid, h.cell_id, erid)
            return GenResult(out, lps, finish, v, cached or 0, h.cell_id, t0, time.time())
        raise ApiError(
            503,
            f"no engine could finish the call after {MAX_ATTEMPTS} attempts",
            type="service_unavailable",
        )

    @staticmethod
    def _handle(call: Call, h) -> tuple[str, int] | None:
        """(engine rid, k) when ``h`` holds a context starting with this call's first k ids:
        its parent's context, generated there in one engine request's ids + output (a stop
        trim only shortens the parent's recorded context, so it stays a prefix of it)."""
        inp = call.inp
        if not h.prefix_handles or inp.parent_request_id is None or inp.prefix_len <= 0:
            return None
        got = call.session.engine_rids.get(inp.parent_request_id)
        if got is None or got[0] != h.cell_id:
            return None
        return got[1], inp.prefix_len

    @staticmethod
    def _held(s: Session, rid: str, cell_id: str, erid: str, keep: int = 8) -> None:
        """Remember that ``cell_id`` holds call ``rid``'s context as engine rid ``erid``."""
        s.engine_rids.pop(rid, None)
        s.engine_rids[rid] = (cell_id, erid)
        while len(s.engine_rids) > keep:
            s.engine_rids.pop(next(iter(s.engine_rids)))

    async def cell_for(self, s: Session):
        """The session's cell; with none serving (the only rollout cell was lost, or moved
        away), wait up to ``gw.engine_wait_s`` for one to join before answering 503."""
        gw = self.gw
        try:
            return await gw.cell_for(s)
        except NoEngineError as exc:
            if await gw.wait_for_engine(gw.engine_wait_s):
                try:
                    return await gw.cell_for(s)
                except NoEngineError:
                    pass
            raise ApiError(
                503,
                f"{exc}, and none joined within {gw.engine_wait_s:.0f}s",
                type="service_unavailable",
            ) from exc

    def finish(self, call: Call, res: GenResult) -> Answer:
        """Cut the output at the first stop string (ids and logprobs to the token that completed
        it), and read tool calls out of it when the call offered tools."""
        text, _ = self.trim_stop(res, call.gp.stop)
        content, tool_calls = parse_output(text) if call.parse_tools else (text, [])
        if tool_calls:
            reason = "tool_calls"
        else:
            reason = "length" if res.finish_type == "length" else "stop"
        return Answer(res, text, content, tool_calls, reason)

    def trim_stop(self, res: GenResult, stops: list[str]) -> tuple[str, str | None]:
        """Decoded text, cut before the first stop string (output ids/logprobs cut to the token
        that completed it). Returns (text, matched stop or None)."""
        tok = self.gw.tok
        text = tok.decode(res.output_ids)
        if not stops or apply_stop(text, stops) is None:
            return text, None
        lo, hi = 1, len(res.output_ids)  # smallest n whose decoding holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if apply_stop(tok.decode(res.output_ids[:mid]), stops) is not None:
                hi = mid
            else:
                lo = mid + 1
        res.output_ids = res.output_ids[:lo]
        res.logprobs = res.logprobs[:lo]
        text = tok.decode(res.output_ids)
        i = apply_stop(text, stops)
        matched = next(x for x in stops if x and text.startswith(x, i))
        res.finish = {"type": "stop", "matched": matched}
        return text[:i], matched

    async def record(self, call: Call, answer: Answer) -> None:
        """Durably append the call's TITO record, then remember it in the session."""
        gw, s, inp, res = self.gw, call.session, call.inp, answer.res
        reply = answer_key(call, answer)
        if call.render is not None:
            answer.body = call.render(answer)
        rec = TitoRecord(
            run_id=gw.run_id,
            session_id=s.session_id,
            request_id=call.rid,
            seq_no=s.next_seq(),
            parent_request_id=inp.parent_request_id,
            prefix_len=inp.prefix_len,
            new_input_ids=inp.new_input_ids.copy(),  # not a view: the input is freed now
            output_ids=np.asarray(res.output_ids, dtype=np.int32),
            output_logprobs=np.asarray(res.logprobs, dtype=np.float32),
            weight_version=res.weight_version,
            cell_id=res.cell_id,
            finish_reason=res.finish_type,
            cached_tokens=res.cached_tokens,
            t_start=res.t_start,
            t_end=res.t_end,
            endpoint=call.endpoint,
            request_json=call.request_json,
            response_json=dumps(answer.body).decode() if answer.body is not None else None,
        )
        await gw.tito.append_async(rec)
        with s.state_lock:
            s.calls.add(
                call.rid, rec.seq_no, inp, rec.output_ids, reply=reply, im_end_id=gw.tok.im_end_id
            )
        s.last_request_id = call.rid
        if inp.msg_key is not None and reply is not None:
            gw.journal_reply(s.session_id, call.rid, inp.msg_key, digest(reply))
        gw.counters["calls"] += 1
        gw.counters["tokens_in"] += len(inp.input_ids)
        gw.counters["tokens_out"] += len(res.output_ids)
        s.tokens += len(inp.new_input_ids) + len(res.output_ids)


def answer_key(call: Call, answer: Answer) -> bytes | None:
    """The key of the reply as the harness will send it back (chat-shaped calls only)."""
    if call.inp.msg_key is None:
        return None
    return reply_key(answer.content, answer.tool_calls)


def _lps(resp: dict) -> list[float]:
    meta = resp.get("meta_info") or {}
    return [
        float(x[0]) if x[0] is not None else float("nan")
        for x in meta.get("output_token_logprobs") or []
    ]
