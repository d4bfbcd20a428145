"""Chat request bodies parsed once and cheaply: only what is new since the session's last call.

A harness re-sends its whole conversation on every call, so at ~1M tokens a body is ~4 MB of
which all but the last few KB are the bytes of its previous body. Parsing and validating all
of it every call (pydantic: ~6 ms at 1M tokens; orjson alone ~8 ms) makes the gateway's cost
grow with the context. Instead, per session, the last chat body is kept (`BodyMemo`: its bytes,
where its last message ends, its message count and chain key); a new body that starts with
the same bytes up to there holds the same messages, and only the rest is parsed (the stdlib's
C scanner, value by value) and validated (the same pydantic ``ChatRequest``, on the new
messages and the top-level fields only).

Anything else falls back to the full parse (``parse_body``), so every error a bad request gets
is the one it got before: the fast path only ever says "valid, here it is" or "not sure".
What it accepts, the full parse accepts identically: the shared bytes parsed before, the rest
is strict JSON (no NaN/Infinity; a lone surrogate, which the full parse refuses, falls back),
and pydantic validates the same fields in the same strict mode.

Pure module: no HTTP, no event loop.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import ValidationError

from infra.gateway.chat import tools_key
from infra.gateway.wire import ChatRequest

__all__ = ["BodyMemo", "TailBody", "body_memo", "parse_tail"]

_WS = re.compile(r"[ \t\n\r]*")


class NotFast(Exception):
    """The fast path cannot vouch for this body: take the full parse."""


def _no_constant(name: str) -> Any:
    raise NotFast(f"{name} is not JSON")


_SCAN = json.JSONDecoder(parse_constant=_no_constant).scan_once  # (s, i) -> (value, end)
_STRING = json.decoder.scanstring  # (s, i after the quote) -> (str, end)


@dataclass(frozen=True, slots=True)
class BodyMemo:
    """The last chat body of a session, as the fast path needs it (set as one object)."""

    raw: bytes  # the body as received
    end: int  # byte offset just after its last message (its closing brace)
    n: int  # its messages
    before: dict  # its top-level fields before "messages", as parsed
    tools: bytes  # canonical bytes of its tools
    head: dict  # messages[0] as the chat template sees it
    msg_key: bytes  # chain key of all its messages (infra/gateway/chat.py: message_chain)


@dataclass(frozen=True, slots=True)
class TailBody:
    """A body that extends the memo's: the request with only its new messages."""

    request: ChatRequest  # top-level fields, and messages[t:] only
    t: int  # messages before the new ones (the memo's)
    end: int  # byte offset just after the body's last message
    memo: BodyMemo  # the memo it extends


def _ws(s: str, i: int) -> int:
    return _WS.match(s, i).end()


def _value(s: str, i: int) -> tuple[Any, int]:
    try:
        return _SCAN(s, i)
    except StopIteration:
        raise NotFast("no JSON value") from None


def _fields(s: str, i: int, out: dict) -> int:
    """``(, "key": value)* }`` of the top-level object from ``i``; its end (all ws eaten)."""
    i = _ws(s, i)
    while s.startswith(",", i):
        i = _ws(s, i + 1)
        if not s.startswith('"', i):
            raise NotFast("no key")
        key, i = _STRING(s, i + 1)
        i = _ws(s, i)
        if not s.startswith(":", i):
            raise NotFast("no colon")
        if key == "messages" or key in out:
            raise NotFast("repeated key")  # the full parse knows which one wins
        out[key], i = _value(s, _ws(s, i + 1))
        i = _ws(s, i)
    if not s.startswith("}", i):
        raise NotFast("no closing brace")
    i = _ws(s, i + 1)
    if i != len(s):
        raise NotFast("text after the body")
    return i


def _elements(s: str, i: int, out: list) -> int:
    """``(, value)* ]`` of the messages array from ``i``; the index after its ``]``."""
    i = _ws(s, i)
    while s.startswith(",", i):
        v, i = _value(s, _ws(s, i + 1))
        out.append(v)
        i = _ws(s, i)
    if not s.startswith("]", i):
        raise NotFast("no closing bracket")
    return i + 1


def _byte_offset(s: str, i: int) -> int:
    """Bytes of ``s[:i]`` in UTF-8 (what the body holds)."""
    return i if s.isascii() else len(s[:i].encode())


def _check_strings(obj: Any) -> None:
    try:  # orjson refuses lone surrogates, as the full parse does; stdlib json takes them
        orjson.dumps(obj)
    except TypeError:
        raise NotFast("not UTF-8") from None


def parse_tail(raw: bytes, memo: BodyMemo | None) -> TailBody | None:
    """The body's new messages and top-level fields, validated, when ``raw`` starts with the
    memo's body up to its last message; None when the full parse must decide."""
    if memo is None or len(raw) <= memo.end or not raw.startswith(memoryview(memo.raw)[: memo.end]):
        return None
    try:
        s = raw[memo.end :].decode()
        new: list = []
        i = _elements(s, 0, new)
        after: dict = {}
        _fields(s, i, after)
        if not new or any(k in memo.before for k in after):
            return None
        _check_strings([after, new])
        request = ChatRequest.model_validate({**memo.before, **after, "messages": new}, strict=True)
    except (NotFast, ValueError, ValidationError, RecursionError):
        return None
    if tools_key(request.tools) != memo.tools:
        return None  # the chain keys start from the tools
    i_last = i - 1  # the messages array's "]": the last message ends before it (ws aside)
    end = memo.end + _byte_offset(s, len(s[:i_last].rstrip(" \t\n\r")))
    return TailBody(request, memo.n, end, memo)


def body_memo(
    raw: bytes,
    request: ChatRequest,
    head: dict,
    tools: bytes,
    msg_key: bytes,
    tail: TailBody | None,
) -> BodyMemo | None:
    """The memo of a body the gateway accepted: from the tail parse that read it, or (after a
    full parse) by scanning it once for where its messages end; None if it is not shaped so
    (a harness whose bodies the fast path cannot follow pays the full parse every call)."""
    if tail is not None:
        n = tail.t + len(request.messages)
        return BodyMemo(raw, tail.end, n, tail.memo.before, tools, head, msg_key)
    try:
        s = raw.decode()
        i = _ws(s, 0)
        if not s.startswith("{", i):
            return None
        before: dict = {}
        i = _ws(s, i + 1)
        while s.startswith('"', i):
            key, i = _STRING(s, i + 1)
            i = _ws(s, i)
            if not s.startswith(":", i) or key in before:
                return None
            i = _ws(s, i + 1)
            if key == "messages":
                break
            before[key], i = _value(s, i)
            i = _ws(s, i)
            if not s.startswith(",", i):
                return None
            i = _ws(s, i + 1)
        else:
            return None
        if not s.startswith("[", i):
            return None
        msgs: list = []
        first, i = _value(s, _ws(s, i + 1))
        msgs.append(first)
        i = _elements(s, i, msgs)
        _fields(s, i, {})  # the rest is well formed (its values: the full parse had them)
    except (NotFast, ValueError, RecursionError):
        return None
    if len(msgs) != len(request.messages):
        return None
    end = _byte_offset(s, len(s[: i - 1].rstrip(" \t\n\r")))
    return BodyMemo(raw, end, len(msgs), before, tools, head, msg_key)
