"""The gateway's one SSE pump, and what each endpoint's stream shows.

``pump`` runs a call through the pipeline as a task and turns its cumulative token updates into
Server-Sent Events through a `StreamView` (chat, text completions, native ``/generate``,
responses). The view's ``tail`` (the final chunks) goes out only once the pipeline returned,
i.e. after the TITO record is durable. A harness that hangs up stops a call that is still
generating; a call already generated is recorded all the same (`infra.gateway.pipeline`).
Updates that queue up while the client is slow are merged (they are cumulative).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Protocol

from infra.gateway.chat import ChatTokenizer, apply_stop
from infra.gateway.replies import (
    SSE_DONE,
    chat_chunk,
    chat_logprobs,
    completion_body,
    completion_logprobs,
    native_body,
    sse,
    usage,
    usage_chunk,
)
from infra.gateway.wire import ApiError

if TYPE_CHECKING:
    from infra.gateway.core import GatewayCore
    from infra.gateway.pipeline import Answer, Call

log = logging.getLogger(__name__)

SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_DONE = object()  # the pipeline task ended
_GONE = object()  # the client disconnected


class StreamView(Protocol):
    end: bytes  # after the last event ([DONE] for the chat-era APIs)

    def head(self) -> list[bytes]: ...
    def update(self, out: list[int], lps: list[float]) -> list[bytes]: ...
    def tail(self, answer: Answer) -> list[bytes]: ...
    def error(self, exc: ApiError) -> list[bytes]: ...


class _OpenAIView:
    """Defaults of the chat-era streams: errors as one ``data: {"error": ...}`` event."""

    end = SSE_DONE

    def error(self, exc: ApiError) -> list[bytes]:
        return [sse(exc.body())]


async def pump(gw: GatewayCore, call: Call, view: StreamView, send, receive) -> None:
    """Answer ``call`` as an SSE stream on an ASGI ``send``; ``receive`` tells a disconnect."""
    q: asyncio.Queue = asyncio.Queue()
    task = asyncio.ensure_future(gw.pipeline.run(call, lambda out, lps: q.put_nowait((out, lps))))
    task.add_done_callback(lambda _: q.put_nowait(_DONE))
    watch = asyncio.ensure_future(_watch_disconnect(receive, q))
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    try:
        await _send(send, view.head())
        done = False
        while not done:
            items = [await q.get()]
            while not q.empty():
                items.append(q.get_nowait())
            if any(x is _GONE for x in items):
                return
            done = any(x is _DONE for x in items)
            updates = [x for x in items if type(x) is tuple]
            if updates:  # cumulative: the newest holds every earlier one
                await _send(send, view.update(*updates[-1]))
        try:
            answer = task.result()
        except ApiError as exc:
            gw.counters["errors"] += 1
            await _send(send, [*view.error(exc), view.end], last=True)
            return
        except Exception as exc:  # a bug or a storage failure: say so, keep serving
            log.exception("stream %s failed", call.rid)
            gw.counters["errors"] += 1
            err = ApiError(500, f"internal error: {type(exc).__name__}", type="internal_error")
            await _send(send, [*view.error(err), view.end], last=True)
            return
        await _send(send, [*view.tail(answer), view.end], last=True)
    finally:
        watch.cancel()
        if not task.done() and not call.generated:
            task.cancel()  # nobody reads it: stop generating (a generated call is recorded)
        elif task.done() and not task.cancelled():
            task.exception()  # retrieved (a harness gone before the answer did not see it)


async def _watch_disconnect(receive, q: asyncio.Queue) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    q.put_nowait(_GONE)


async def _send(send, chunks: list[bytes], *, last: bool = False) -> None:
    if chunks or last:
        await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": not last})


def _held(text: str, stops: list[str], hold: int) -> str:
    """Text safe to show: cut at a stop string, and without its last ``hold`` characters
    (they may be the start of a stop string the next tokens complete)."""
    if not stops:
        return text
    i = apply_stop(text, stops)
    return text[:i] if i is not None else text[: max(0, len(text) - hold)]


class ChatStream(_OpenAIView):
    """``chat.completion.chunk`` events: content deltas (tool-call blocks held back and sent
    parsed at the end), per-token logprobs, the finish reason, usage on request."""

    def __init__(self, tok: ChatTokenizer, call: Call, model: str):
        self.tok, self.call, self.model = tok, call, model
        self.hold = max((len(x) for x in call.gp.stop), default=1) - 1
        self.sent = ""
        self.sent_lp = 0

    def _chunk(self, delta: dict, finish: str | None = None, lp: dict | None = None) -> bytes:
        c = self.call
        return sse(chat_chunk(c.rid, self.model, c.created, delta, finish, lp))

    def _lp(self, out: list[int], lps: list[float]) -> dict | None:
        if not self.call.gp.logprobs or len(out) <= self.sent_lp:
            return None
        lp = chat_logprobs(
            [self.tok.token_str(t) for t in out[self.sent_lp :]], lps[self.sent_lp :]
        )
        self.sent_lp = len(out)
        return lp

    def head(self) -> list[bytes]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def update(self, out: list[int], lps: list[float]) -> list[bytes]:
        text = self.tok.decode(out)
        if self.call.parse_tools:
            i = text.find("<tool_call>")
            text = (text[:i] if i >= 0 else text).rstrip()
        text = _held(text, self.call.gp.stop, self.hold).rstrip("\ufffd")
        delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
        lp = self._lp(out, lps)
        if not (delta or lp):
            return []
        self.sent += delta
        return [self._chunk({"content": delta}, None, lp)]

    def tail(self, a: Answer) -> list[bytes]:
        out: list[bytes] = []
        content = a.content or ""
        rest = content[len(self.sent) :] if content.startswith(self.sent) else ""
        lp = self._lp(a.res.output_ids, a.res.logprobs)
        if rest or lp:
            out.append(self._chunk({"content": rest}, None, lp))
        if a.tool_calls:
            tc = [{"index": i, **c} for i, c in enumerate(a.tool_calls)]
            out.append(self._chunk({"tool_calls": tc}))
        out.append(self._chunk({}, a.finish_reason))
        if self.call.gp.include_usage:
            c = self.call
            use = usage(c.n_in, len(a.res.output_ids), a.res.cached_tokens)
            out.append(sse(usage_chunk(c.rid, self.model, c.created, use)))
        return out


class CompletionStream(_OpenAIView):
    """``text_completion`` events: text deltas (stop strings held back), each with the
    logprobs of the tokens generated since the last chunk when asked (``logprobs=0``;
    ``text_offset`` counts from the start of the completion), then the finish."""

    def __init__(self, tok: ChatTokenizer, call: Call, model: str):
        self.tok, self.call, self.model = tok, call, model
        self.hold = max((len(x) for x in call.gp.stop), default=1) - 1
        self.sent = ""
        self.sent_lp = 0  # tokens whose logprobs were sent
        self.offset = 0  # characters of those tokens

    def _chunk(self, text: str, finish: str | None = None, lp: dict | None = None) -> bytes:
        c = self.call
        return sse(completion_body(c.rid, self.model, text, finish, None, lp, c.created))

    def _lp(self, out: list[int], lps: list[float]) -> dict | None:
        if not self.call.gp.logprobs or len(out) <= self.sent_lp:
            return None
        strs = [self.tok.token_str(t) for t in out[self.sent_lp :]]
        lp = completion_logprobs(strs, lps[self.sent_lp : len(out)])
        lp["text_offset"] = [self.offset + o for o in lp["text_offset"]]
        self.sent_lp, self.offset = len(out), self.offset + sum(len(x) for x in strs)
        return lp

    def head(self) -> list[bytes]:
        return []

    def update(self, out: list[int], lps: list[float]) -> list[bytes]:
        text = _held(self.tok.decode(out).rstrip("\ufffd"), self.call.gp.stop, self.hold)
        if not (text.startswith(self.sent) and len(text) > len(self.sent)):
            return []
        delta, self.sent = text[len(self.sent) :], text
        return [self._chunk(delta, None, self._lp(out, lps))]

    def tail(self, a: Answer) -> list[bytes]:
        rest = a.text[len(self.sent) :] if a.text.startswith(self.sent) else ""
        out = [self._chunk(rest, a.finish_reason, self._lp(a.res.output_ids, a.res.logprobs))]
        if self.call.gp.include_usage:
            c = self.call
            use = usage(c.n_in, len(a.res.output_ids), a.res.cached_tokens)
            out.append(sse(usage_chunk(c.rid, self.model, c.created, use, chat=False)))
        return out


class NativeStream(_OpenAIView):
    """SGLang ``/generate`` events: each chunk the whole answer so far, the last one final."""

    def __init__(self, tok: ChatTokenizer, call: Call):
        self.tok, self.call = tok, call

    def body(self, out: list[int], lps: list[float], text: str, **final: Any) -> dict:
        c = self.call
        kw = {"finish": None, "cached_tokens": 0, "weight_version": -1, "cell_id": "", **final}
        return native_body(c.rid, c.n_in, out, lps, text=text, with_logprobs=c.gp.logprobs, **kw)

    def head(self) -> list[bytes]:
        return []

    def update(self, out: list[int], lps: list[float]) -> list[bytes]:
        return [sse(self.body(out, lps, self.tok.decode(out)))]

    def tail(self, a: Answer) -> list[bytes]:
        return [sse(final_native(self, a))]


def final_native(view: NativeStream, a: Answer) -> dict:
    """The complete ``/generate`` answer of a recorded call (a stream's last chunk too)."""
    r = a.res
    return view.body(
        r.output_ids,
        r.logprobs,
        a.text,
        finish=r.finish,
        cached_tokens=r.cached_tokens,
        weight_version=r.weight_version,
        cell_id=r.cell_id,
    )
