"""Chat bodies parsed from where the session's last one ended (infra/gateway/chat_body.py), the
spine of a session's call index, and the JSON of input ids encoded once: hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from infra.engine_api.client import EngineClient, _body, _dumps
from infra.gateway.call_index import CHUNK, ChatInput, SessionCalls, chunk_hashes
from infra.gateway.chat_body import ROPE_MIN, Arriving, body_memo, parse_tail
from infra.gateway.ids_json import IdsJsonCache
from infra.gateway.wire import ChatRequest, parse_body

HEAD = {"role": "user", "content": "hé"}
B1 = '{"model": "m", "messages": [{"role": "user", "content": "hé"} ], "max_tokens": 8}'.encode()
# B1 + the reply + a new turn, with other whitespace and a non-ASCII character after the prefix
B2 = (
    '{"model": "m", "messages": [{"role": "user", "content": "hé"},\n'
    ' {"role": "assistant", "content": "Hi"},{"role":"user","content":"ñx"}\n],'
    ' "max_tokens": 8}'
).encode()


def _memo(raw: bytes = B1):
    return body_memo(raw, parse_body(ChatRequest, raw), HEAD, b"[]", b"K", None)


def _tail(raw: bytes, memo, part: int = 0):
    return parse_tail(Arriving.of(raw, memo, part), memo)


def test_the_memo_of_a_full_parse_ends_right_after_the_last_message():
    m = _memo()
    # '{"model": "m", "messages": [' is 28 bytes, the message 33 chars / 34 bytes (é: 2)
    assert m.end == 28 + 34 and B1[: m.end].endswith('"hé"}'.encode())
    assert (m.n, m.before, m.msg_key) == (1, {"model": "m"}, b"K")


def test_a_body_extending_the_memo_is_parsed_from_there():
    t = _tail(B2, _memo())
    assert t is not None and t.t == 1
    assert [(x.role, x.content) for x in t.request.messages] == [
        ("assistant", "Hi"),
        ("user", "ñx"),
    ]
    assert (t.request.model, t.request.max_tokens) == ("m", 8)
    assert B2[: t.end].endswith('"ñx"}'.encode()) and B2[t.end :].startswith(b"\n]")
    # the tail's memo ends where a full parse of the same body says
    full = body_memo(B2, parse_body(ChatRequest, B2), HEAD, b"[]", b"K2", None)
    nxt = body_memo(None, t.request, HEAD, b"[]", b"K2", t)
    assert (
        (nxt.end, nxt.n, nxt.before)
        == (full.end, full.n, full.before)
        == (t.end, 3, {"model": "m"})
    )
    # request_json of the tail: messages from the reply on (at = 1), as the full body's
    whole = parse_body(ChatRequest, B2)
    assert t.request.request_json("c1", 1, offset=1) == whole.request_json("c1", 1)


@pytest.mark.parametrize("part", [1, 7, 61, 62, 63, 0])
def test_a_body_arriving_in_parts_keeps_only_the_bytes_past_the_memo(part):
    m = _memo()  # its rope: B1's first 62 bytes
    got = Arriving.of(B2, m, part)
    assert got.extends and got.matched == m.end == 62
    assert got.tail == B2[62:] and sum(map(len, got.rest)) == len(B2) - 62  # nothing before
    t = parse_tail(got, m)
    assert t is not None and t.tail == B2[62:] and t.end == _tail(B2, m).end
    assert got.whole() == B2 and not got.extends  # joined once, from the rope + the rest
    # a part that differs is kept whole, and so is everything after it
    bad = B2.replace(b'"m"', b'"n"', 1)
    other = Arriving.of(bad, m, part)
    assert not other.extends and other.whole() == bad and parse_tail(other, m) is None


def test_a_memo_is_a_rope_of_each_calls_new_bytes_with_short_segments_merged():
    m = _memo()
    assert m.rope == (memoryview(B1)[:62],) and bytes(m.rope[0]) == B1[:62]
    raw, n = B1[:62], 1
    memos = [m]
    for i in range(40):  # each call: its reply + a new user turn of ~2 KB (~30 ASCII: merged)
        text = "x" * (2000 if i % 2 else 30)
        new = f', {{"role": "assistant", "content": "Hi"}}, {{"role": "user", "content": "{text}"}}'
        body = raw + new.encode() + b'], "max_tokens": 8}'
        t = _tail(body, m)
        assert t is not None and t.t == n and t.tail == body[len(raw) :]
        m = body_memo(None, t.request, HEAD, b"[]", b"K", t)
        raw, n = body[: t.end], n + 2
        assert b"".join(m.rope) == raw and m.end == len(raw)
        memos.append(m)
    # binary-counter merging: O(log calls) segments, none shorter than ROPE_MIN bar the last
    assert len(m.rope) <= 8 and all(len(s) >= ROPE_MIN for s in m.rope[:-1])
    assert all(len(a) > len(b) for a, b in zip(m.rope[:-1], m.rope[1:], strict=True))
    # an earlier memo is left as it was (a rope is never written in place)
    assert b"".join(memos[1].rope) == b"".join(memos[2].rope)[: memos[1].end]


@pytest.mark.parametrize(
    "bad",
    [
        B2.replace('"hé"}'.encode(), '"hë"}'.encode(), 1),  # an earlier message edited
        B2.replace(b'"Hi"', b"NaN"),  # not JSON (stdlib json would take it)
        B2.replace(b'"Hi"', b'"\\ud800"'),  # a lone surrogate (the full parse refuses it)
        B2.replace(b'"max_tokens": 8', b'"model": "x"'),  # a key before the messages again
        B2.replace(b'"max_tokens": 8', b'"messages": []'),  # the messages twice
        B2.replace(b'"max_tokens": 8', b'"tools": [{"type": "function"}]'),  # other tools
        B2 + b"x",  # text after the body
        B2.replace(b'"role":"user",', b""),  # a new message without its role
        B2.replace(b'"max_tokens": 8', b'"max_tokens": 8.0'),  # a float where an int goes
        B2.replace(b"\n],", b"\n,],"),  # a trailing comma
        B1,  # nothing new
    ],
)
def test_anything_else_takes_the_full_parse(bad):
    assert _tail(bad, _memo()) is None


def test_no_memo_or_a_different_prefix_takes_the_full_parse():
    assert _tail(B2, None) is None
    assert _tail(B2.replace(b'"m"', b'"n"', 1), _memo()) is None
    m = _memo()
    assert parse_tail(Arriving.of(B2, _memo()), m) is None  # compared with another memo


def _add(calls: SessionCalls, rid: str, ids, out, seq: int, hint=None) -> ChatInput:
    arr = np.asarray(ids, dtype=np.int32)
    parent, k, hashes = calls.find_parent(arr, hint=hint)
    inp = ChatInput(arr, parent, k, "tokens", hashes=hashes)
    calls.add(rid, seq, inp, np.asarray(out, dtype=np.int32))
    return inp


def test_a_linear_session_lives_on_one_spine_and_a_branch_off_it_is_copied():
    calls = SessionCalls()
    a = list(range(1, 301))  # 300 tokens: one full chunk + 44
    _add(calls, "a", a, [7, 8], 0)
    b = [*a, 7, 8, 9, 10]
    inp_b = _add(calls, "b", b, [11], 1, hint="a")
    assert (inp_b.parent_request_id, inp_b.prefix_len) == ("a", 302)
    ca, cb = calls.calls["a"], calls.calls["b"]
    assert ca.on_spine and cb.on_spine and ca.own is None and cb.own is None
    assert ca.hashes is None and cb.hashes is None
    assert calls.context("b").tolist() == [*b, 11]
    assert calls.context("a").tolist() == [*a, 7, 8]
    # a branch: shares 100 tokens of a's context, then differs
    c = [*a[:100], 999, 998]
    inp_c = _add(calls, "c", c, [5], 2)
    cc = calls.calls["c"]
    assert (inp_c.parent_request_id, inp_c.prefix_len) == ("b", 100)
    assert not cc.on_spine and cc.own.tolist() == [999, 998, 5]
    assert calls.context("c").tolist() == [*c, 5]
    # the main line goes on: back on the spine, with the spine's digests == from scratch
    d = [*b, 11, 12]
    inp_d = _add(calls, "d", d, [13], 3, hint="b")
    assert calls.calls["d"].on_spine and inp_d.prefix_len == len(b) + 1
    full = [*d, 13]
    assert calls.context("d").tolist() == full
    assert calls._hashes(calls.calls["d"], len(full) // CHUNK) == chunk_hashes(
        np.array(full, np.int32)
    )
    # the branch's parent lookup still sees every call's tokens
    again = np.asarray([*c, 5, 6], dtype=np.int32)
    assert calls.find_parent(again)[:2] == ("c", len(c) + 1)


def test_ids_json_encodes_only_what_a_continuation_adds():
    cache = IdsJsonCache()
    first = cache.encode("r1", np.array([5, 6, 7], np.int32), None, 0)
    assert bytes(cache.buf) == b"5,6,7" and len(first) == 3
    cache.encode("r2", np.array([5, 6, 7, 8, 9], np.int32), "r1", 4)  # r1's input + more
    assert bytes(cache.buf) == b"5,6,7,8,9"
    cache.encode("r3", np.array([5, 6, 1], np.int32), "r2", 2)  # shares less: from scratch
    assert bytes(cache.buf) == b"5,6,1"
    ids = np.array([4, 2], np.int32)
    got = cache.encode("r4", ids, None, 0)
    payload = EngineClient._payload(got, {"max_new_tokens": 3}, "r4", True, False)
    want = EngineClient._payload(ids, {"max_new_tokens": 3}, "r4", True, False)
    assert _body(payload) == _dumps(want)


def test_an_input_built_past_the_spine_end_is_lent_to_one_call_at_a_time():
    calls = SessionCalls()
    a = list(range(1, 11))
    _add(calls, "a", a, [11], 0)
    v = calls.extend_on_spine("a", np.array([12, 13], np.int32))
    assert v.tolist() == [*range(1, 12), 12, 13] and np.shares_memory(v, calls._spine)
    w = calls.extend_on_spine("a", np.array([14], np.int32))  # v is alive: a copy
    assert w.tolist() == [*range(1, 12), 14] and not np.shares_memory(w, calls._spine)
    assert v.tolist() == [*range(1, 12), 12, 13]  # not written under
    # the copy's call records first: off the spine, so v's tokens stay where they are
    parent, k, hashes = calls.find_parent(w, hint="a")
    calls.add("w", 1, ChatInput(w, parent, k, "extend", hashes=hashes), np.array([9], np.int32))
    assert not calls.calls["w"].on_spine and v.tolist() == [*range(1, 12), 12, 13]
    # (a's context is v's prefix: find_parent would name w, the latest call sharing as much)
    calls.add("v", 2, ChatInput(v, "a", 11, "extend"), np.array([15], np.int32))
    assert calls.calls["v"].on_spine and calls.context("v").tolist() == [*range(1, 14), 15]
    assert calls.context("w").tolist() == [*range(1, 12), 14, 9]
    del v, w  # released: the next input is built on the spine again
    u = calls.extend_on_spine("v", np.array([16], np.int32))
    assert np.shares_memory(u, calls._spine) and u.tolist() == [*range(1, 14), 15, 16]
