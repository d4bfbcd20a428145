"""Chat request bodies parsed once and cheaply: only what is new since the session's last call.

A harness re-sends its whole conversation on every call, so at ~1M tokens a body is ~4 MB of
which all but the last few KB are the bytes of its previous body. Parsing and validating all
of it every call (pydantic: ~6 ms at 1M tokens; orjson alone ~8 ms) makes the gateway's cost
grow with the context. Instead, per session, the last chat body is kept (`BodyMemo`: its bytes
up to where its last message ends, its message count and chain key); a new body that starts
with the same bytes up to there holds the same messages, and only the rest is parsed (the
stdlib's C scanner, value by value) and validated (the same pydantic ``ChatRequest``, on the
new messages and the top-level fields only).

Nor is the body ever held whole: it is compared with the memo as it arrives (`Arriving`,
part by part, each part dropped once compared), so only the bytes past the memo's end are
kept, and the memo is a rope of each call's new bytes (`BodyMemo.rope`: no copy of the
context per call). At 1M tokens a whole-body join was a 3 MB buffer per call, which either
page-faulted in fresh (glibc maps such a buffer on its own) or stayed resident in the heap.

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

__all__ = ["Arriving", "BodyMemo", "TailBody", "body_memo", "parse_tail"]

_WS = re.compile(r"[ \t\n\r]*")


class NotFast(Exception):
    """The fast path cannot vouch for this body: take the full parse."""


def _no_constant(name: str) -> Any:
    raise NotFast(f"{name} is not JSON")


_SCAN = json.JSONDecoder(parse_constant=_no_constant).scan_once  # (s, i) -> (value, end)
_STRING = json.decoder.scanstring  # (s, i after the quote) -> (str, end)


ROPE_MIN = 4096  # a rope's segments shorter than this (and than their successor) are merged


@dataclass(frozen=True, slots=True)
class BodyMemo:
    """The last chat body of a session, as the fast path needs it (set as one object)."""

    rope: tuple  # the body's first ``end`` bytes, as consecutive segments (bytes-like)
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
    tail: bytes  # the body's bytes from memo.end on


class Arriving:
    """A request body as it arrives, compared part by part with a memo's bytes: what matches
    them is dropped (the memo holds it), what follows is kept. ``feed`` each part, then read
    `tail` (the bytes past the memo's end, when all before matched) or `whole` (the body).
    Work per part: one memcmp of its bytes, no copy of what matched."""

    __slots__ = ("_at", "_seg", "matched", "memo", "rest", "size")

    def __init__(self, memo: BodyMemo | None) -> None:
        self.memo = memo
        self.size = 0  # bytes fed
        self.matched = 0  # leading bytes equal to the memo's (<= memo.end)
        self.rest: list[bytes] = []  # the bytes from `matched` on
        self._seg, self._at = 0, 0  # where `matched` falls in the memo's rope

    @classmethod
    def of(cls, raw: bytes, memo: BodyMemo | None, part: int = 0) -> Arriving:
        """``raw`` fed at once (or in parts of ``part`` bytes)."""
        got = cls(memo)
        step = part or max(1, len(raw))
        for i in range(0, len(raw), step):
            got.feed(raw[i : i + step])
        return got

    def feed(self, part: bytes) -> None:
        memo, n = self.memo, len(part)
        if memo is not None and self.matched == self.size < memo.end and n:
            k = self._match(part, min(n, memo.end - self.size))
            self.matched += k
            if k < n:
                self.rest.append(part[k:] if k else part)
        elif n:
            self.rest.append(part)
        self.size += n

    def _match(self, part: bytes, want: int) -> int:
        """``want`` if part's first ``want`` bytes are the rope's at ``matched``, else 0."""
        rope, seg, at, i = self.memo.rope, self._seg, self._at, 0
        while i < want:
            s = rope[seg]
            k = min(len(s) - at, want - i)
            if not part.startswith(memoryview(s)[at : at + k], i):
                return 0  # the part differs: kept whole, and nothing more is compared
            i, at = i + k, at + k
            if at == len(s):
                seg, at = seg + 1, 0
        self._seg, self._at = seg, at
        return want

    @property
    def extends(self) -> bool:
        """The body starts with the memo's bytes (its messages) and has more after them."""
        return self.memo is not None and self.matched == self.memo.end < self.size

    @property
    def tail(self) -> bytes:
        """The body from ``matched`` on (from the memo's end on, when it `extends`)."""
        return self.rest[0] if len(self.rest) == 1 else b"".join(self.rest)

    def whole(self) -> bytes:
        """The whole body (the matched bytes from the memo's rope), joined once."""
        if self.matched:
            head, need = [], self.matched
            for s in self.memo.rope:
                head.append(memoryview(s)[:need])
                need -= len(head[-1])
                if not need:
                    break
            self.rest, self.matched, self._seg, self._at = [b"".join([*head, *self.rest])], 0, 0, 0
        return self.tail


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


def parse_tail(body: Arriving, memo: BodyMemo | None) -> TailBody | None:
    """The body's new messages and top-level fields, validated, when it starts with the
    memo's body up to its last message; None when the full parse must decide."""
    if memo is None or body.memo is not memo or not body.extends:
        return None
    tail = body.tail
    try:
        s = tail.decode()
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
    return TailBody(request, memo.n, end, memo, tail)


def _rope(rope: tuple, seg: bytes) -> tuple:
    """``rope`` + ``seg``, with short segments merged (binary-counter style: a segment is
    merged into the one before while that one is no longer), so that a session of many calls
    holds O(log calls) segments and each byte is copied O(log calls) times in all."""
    out = [*rope, seg]
    while len(out) > 1 and (len(out[-2]) <= len(out[-1]) or len(out[-2]) < ROPE_MIN):
        last = out.pop()
        out[-1] = b"".join([out[-1], last])
    return tuple(out)


def body_memo(
    raw: bytes | None,
    request: ChatRequest,
    head: dict,
    tools: bytes,
    msg_key: bytes,
    tail: TailBody | None,
) -> BodyMemo | None:
    """The memo of a body the gateway accepted: from the tail parse that read it (``raw`` is
    not needed: the memo's rope + the tail's bytes to its last message), or (after a full
    parse of ``raw``) by scanning it once for where its messages end; None if it is not shaped
    so (a harness whose bodies the fast path cannot follow pays the full parse every call)."""
    if tail is not None:
        n = tail.t + len(request.messages)
        m = tail.memo
        rope = _rope(m.rope, tail.tail[: tail.end - m.end])
        return BodyMemo(rope, tail.end, n, m.before, tools, head, msg_key)
    if raw is None:
        return None
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
    seg = raw if end == len(raw) else memoryview(raw)[:end]  # no copy of a whole body
    return BodyMemo((seg,), end, len(msgs), before, tools, head, msg_key)
