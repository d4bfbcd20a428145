"""OpenAI Responses API (``POST /v1/responses``) as a view of a chat call.

A Responses request is turned into chat messages (``instructions`` -> system turn, input items
-> messages: ``function_call`` items become the assistant turn's ``tool_calls``,
``function_call_output`` items tool turns), prefixed by the conversation that
``previous_response_id`` names; then it runs through the same pipeline as a chat call (token
exact, recorded as TITO with ``endpoint="responses"``) and the answer is rendered as a
``response`` object (or its stream of ``response.*`` events). The conversation after each
recorded response is remembered in its session (as a chain: each response keeps only the
messages it added) with its response object, so a later call can continue it by id and
``GET /v1/responses/{id}`` reads it back. Both live in the TITO record too (``request_json``,
``response_json``), so they survive a gateway restart (`restore`).

Pure module: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationError

from infra.gateway.chat import ChatTokenizer, apply_stop
from infra.gateway.wire import (
    ApiError,
    Body,
    FunctionDef,
    GenParams,
    Int64,
    Stop,
    _stops,
    bad,
    dumps,
    loads,
    refuse_one_tool_call,
    refuse_unsupported,
    validation_error,
)

if TYPE_CHECKING:
    from infra.gateway.pipeline import Answer, Call
    from infra.gateway.sessions import Session
    from storage.tito import TitoRecord


class ResponsesRequest(Body):
    """``POST /v1/responses`` (the fields gyre acts on; unknown ones are ignored, and those it
    cannot honour, a forced tool call, a JSON format, reasoning, are refused: 400)."""

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: Int64 | None = None
    stop: Stop = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def gen_params(self) -> GenParams:
        refuse_one_tool_call(self.parallel_tool_calls)
        fmt = (self.text or {}).get("format")
        refuse_unsupported(
            self.tool_choice, [("text.format", fmt)], [("reasoning", self.reasoning)]
        )
        return GenParams(
            max_new_tokens=self.max_output_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=_stops(self.stop),
            stream=self.stream,
        )

    @property
    def chat_tools(self) -> list[dict] | None:
        """Function tools in the chat shape the template renders."""
        if not self.tools:
            return None
        out = []
        for i, t in enumerate(self.tools):
            if t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise bad("only function tools (with a name) are supported", f"tools[{i}]")
            fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
            try:  # the chat path's rules: OpenAI's names, parameters a JSON Schema object
                FunctionDef.model_validate(fn, strict=True)
            except ValidationError as exc:
                raise validation_error(exc, f"tools[{i}]") from None
            out.append({"type": "function", "function": fn})
        return out

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def request_json(self) -> str:
        """The request as the harness sent it, for the TITO record's ``request_json``: its
        ``input`` (with ``previous_response_id``, only the new items, as the API intends),
        ``instructions``, ``tools`` and ``previous_response_id`` (those it sent)."""
        d: dict[str, Any] = {"input": self.input}
        for k in ("instructions", "tools", "previous_response_id"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return dumps(d).decode()


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or not isinstance(p.get("text", ""), str):
                raise bad("content parts must be objects with a string 'text'", f"{where}[{j}]")
            if p.get("type") in ("input_text", "output_text", "text", None):
                parts.append(p.get("text", ""))
            else:
                raise bad(f"content part type {p.get('type')!r} is not supported", f"{where}[{j}]")
        return "".join(parts)
    raise bad("content must be a string or a list of parts", where)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict]:
    """A request's own input as chat messages (in the template's shape)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    msgs: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad("a message needs role user, system, developer or assistant", where)
            text = _text(item.get("content", ""), f"{where}.content")
            msgs.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            name, args, cid = item.get("name"), item.get("arguments", ""), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(cid, str):
                raise bad("a function_call needs string name, arguments and call_id", where)
            call = {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":  # one turn: text + calls
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out, cid = item.get("output"), item.get("call_id")
            if not isinstance(cid, str):
                raise bad("a function_call_output needs a string call_id", where)
            text = out if isinstance(out, str) else _text(out, f"{where}.output")
            msgs.append({"role": "tool", "tool_call_id": cid, "content": text})
        elif kind == "reasoning":
            continue  # the model's reasoning summary: not part of the template's view
        else:
            raise bad(f"input item type {kind!r} is not supported", f"{where}.type")
    return msgs


def conversation(s: Session, req: ResponsesRequest) -> tuple[list[dict], list[dict]]:
    """(messages the call renders, the messages of its own input). ``instructions`` are this
    call's alone (as in OpenAI's API, they do not carry over with ``previous_response_id``)."""
    history: list[dict] = []
    if req.previous_response_id is not None:
        rid: str | None = req.previous_response_id
        if rid not in s.responses:
            raise ApiError(
                404,
                f"previous response {rid!r} is not a response of this session",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        chain = []
        while rid is not None:
            rid, added, _ = s.responses[rid]
            chain.append(added)
        history = [m for added in reversed(chain) for m in added]
    own = input_messages(req.input)
    if not own and not history:
        raise bad("'input' must hold at least one message", "input")
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return [*system, *history, *own], own


def reply_message(a: Answer) -> dict:
    """The assistant turn as the conversation continues it (what the chat path keys on)."""
    msg: dict[str, Any] = {"role": "assistant", "content": a.content or ""}
    if a.tool_calls:
        msg["tool_calls"] = a.tool_calls
    return msg


def _usage(call: Call, a: Answer) -> dict:
    n_out = len(a.res.output_ids)
    return {
        "input_tokens": call.n_in,
        "input_tokens_details": {"cached_tokens": a.res.cached_tokens},
        "output_tokens": n_out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": call.n_in + n_out,
    }


def _message_item(call: Call, text: str, status: str = "completed") -> dict:
    return {
        "type": "message",
        "id": "msg_" + call.rid.split("-", 1)[1],
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _call_items(a: Answer) -> list[dict]:
    return [
        {
            "type": "function_call",
            "id": "fc_" + tc["id"].removeprefix("call_"),
            "call_id": tc["id"],
            "name": tc["function"]["name"],
            "arguments": tc["function"]["arguments"],
            "status": "completed",
        }
        for tc in a.tool_calls
    ]


def response_body(
    call: Call, req: ResponsesRequest, a: Answer | None, status: str = "completed"
) -> dict:
    """The ``response`` object (``a`` None: a stream's opening, nothing generated yet)."""
    output: list[dict] = []
    incomplete = None
    if a is not None:
        if a.content or not a.tool_calls:
            output.append(_message_item(call, a.content or ""))
        output += _call_items(a)
        if a.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    return {
        "id": call.rid,
        "object": "response",
        "created_at": call.created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": req.model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": True,
        "temperature": call.gp.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "top_p": call.gp.top_p,
        "truncation": "disabled",
        "usage": _usage(call, a) if a is not None else None,
        "metadata": req.metadata or {},
    }


class ResponsesStream:
    """``response.*`` server-sent events: created, text deltas (tool-call blocks and stop
    strings held back), the output items, completed (after the record)."""

    end = b""  # the Responses API sends no [DONE]

    def __init__(
        self,
        tok: ChatTokenizer,
        call: Call,
        req: ResponsesRequest,
        on_answer: Callable[[Answer], None],
    ):
        self.tok, self.call, self.req = tok, call, req
        self.on_answer = on_answer  # the call is recorded: remember its conversation
        self.hold = max((len(x) for x in call.gp.stop), default=1) - 1
        self.sent = ""
        self.seq = 0
        self.opened = False  # the message item was announced

    def _ev(self, kind: str, **data: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(body) + b"\n\n"

    def _open(self) -> list[bytes]:
        self.opened = True
        item = _message_item(self.call, "", "in_progress")
        item["content"] = []
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._ev("response.output_item.added", output_index=0, item=item),
            self._ev(
                "response.content_part.added",
                item_id=item["id"],
                output_index=0,
                content_index=0,
                part=part,
            ),
        ]

    def head(self) -> list[bytes]:
        opening = response_body(self.call, self.req, None, "in_progress")
        return [
            self._ev("response.created", response=opening),
            self._ev("response.in_progress", response=opening),
        ]

    def update(self, out: list[int], lps: list[float]) -> list[bytes]:
        text = self.tok.decode(out)
        if self.call.parse_tools:
            i = text.find("<tool_call>")
            text = (text[:i] if i >= 0 else text).rstrip()
        stops = self.call.gp.stop
        if stops:
            i = apply_stop(text, stops)
            text = text[:i] if i is not None else text[: max(0, len(text) - self.hold)]
        text = text.rstrip("\ufffd")
        delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
        if not delta:
            return []
        events = [] if self.opened else self._open()
        self.sent += delta
        item_id = "msg_" + self.call.rid.split("-", 1)[1]
        events.append(
            self._ev(
                "response.output_text.delta",
                item_id=item_id,
                output_index=0,
                content_index=0,
                delta=delta,
            )
        )
        return events

    def tail(self, a: Answer) -> list[bytes]:
        self.on_answer(a)
        events: list[bytes] = []
        content = a.content or ""
        index = 0
        if content or not a.tool_calls:
            if not self.opened:
                events += self._open()
            rest = content[len(self.sent) :] if content.startswith(self.sent) else ""
            item = _message_item(self.call, content)
            ids = {"item_id": item["id"], "output_index": 0, "content_index": 0}
            if rest:
                events.append(self._ev("response.output_text.delta", **ids, delta=rest))
            part = item["content"][0]
            events += [
                self._ev("response.output_text.done", **ids, text=content),
                self._ev("response.content_part.done", **ids, part=part),
                self._ev("response.output_item.done", output_index=0, item=item),
            ]
            index = 1
        for k, item in enumerate(_call_items(a)):
            events += [
                self._ev("response.output_item.added", output_index=index + k, item=item),
                self._ev(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index + k,
                    arguments=item["arguments"],
                ),
                self._ev("response.output_item.done", output_index=index + k, item=item),
            ]
        final = a.body if a.body is not None else response_body(self.call, self.req, a)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        events.append(self._ev(kind, response=final))
        return events

    def error(self, exc: ApiError) -> list[bytes]:
        return [self._ev("error", code=exc.code, message=exc.message, param=exc.param)]


def remember(s: Session, call: Call, req: ResponsesRequest, own: list[dict], a: Answer) -> None:
    """Keep the conversation after a recorded response, for ``previous_response_id``, and the
    response object, for ``GET /v1/responses/{id}``."""
    body = a.body if a.body is not None else response_body(call, req, a)
    s.responses[call.rid] = (req.previous_response_id, [*own, reply_message(a)], body)


def restore(s: Session, records: Iterable[TitoRecord]) -> None:
    """Refill ``s.responses`` from the session's recorded Responses calls (after a gateway
    restart): each record holds the request as sent and the response object answered, which
    is all a chain needs (records written before ``request_json`` existed are not chained)."""
    for r in sorted(records, key=lambda r: r.seq_no):
        if r.endpoint != "responses" or r.request_json is None or r.response_json is None:
            continue
        req, body = loads(r.request_json), loads(r.response_json)
        own = input_messages(req["input"])
        s.responses[r.request_id] = (req.get("previous_response_id"), [*own, _reply(body)], body)


def _reply(body: dict) -> dict:
    """`reply_message` of a response, read back from its output items."""
    text = "".join(
        p["text"] for it in body["output"] if it["type"] == "message" for p in it["content"]
    )
    calls = [
        {
            "id": it["call_id"],
            "type": "function",
            "function": {"name": it["name"], "arguments": it["arguments"]},
        }
        for it in body["output"]
        if it["type"] == "function_call"
    ]
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return msg
