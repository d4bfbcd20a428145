"""The gateway at long context: the chat chain keys are incremental (earlier messages are
not re-hashed) and still name exactly what the template sees, branches included."""

from __future__ import annotations

import hashlib

import orjson

from infra.gateway.call_index import ChainMemo
from infra.gateway.chat import message_chain


def _reference(messages: list[dict], tools: list | None) -> list[bytes]:
    """The chain from scratch, as the textbook hash chain: key[k] = H(key[k-1] + canon(m))."""

    def canon(o) -> bytes:
        return orjson.dumps(o, option=orjson.OPT_SORT_KEYS)

    def h(prev: bytes, data: bytes) -> bytes:
        return hashlib.blake2b(prev + data, digest_size=16).digest()

    keys = [h(b"tools", canon(tools or []))]
    for m in messages:
        d = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            d["tool_calls"] = [
                {"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}
                for tc in m["tool_calls"]
            ]
        keys.append(h(keys[-1], canon(d)))
    return keys


def _tc(args) -> list[dict]:
    return [{"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]


def test_incremental_chain_equals_the_full_chain_over_a_long_session_with_branches():
    memo = ChainMemo()
    msgs: list[dict] = [{"role": "system", "content": "s"}]
    for i in range(200):
        msgs = [*msgs, {"role": "user", "content": f"u{i}"}]
        assert message_chain(msgs, None, memo) == _reference(msgs, None)
        msgs = [*msgs, {"role": "assistant", "content": f"a{i}", "tool_calls": _tc({"x": i})}]
    # an edited earlier message: a branch, keys from there on differ from the memo's
    before = message_chain(msgs, None, memo)
    edited = [dict(m) for m in msgs]
    edited[5] = {**edited[5], "content": edited[5]["content"] + "!"}
    keys = message_chain(edited, None, memo)
    assert keys == _reference(edited, None)
    assert keys[:6] == before[:6] and keys[6] != before[6]
    # same value, other type (1 == 1.0 == True in Python): different canonical bytes
    typed = [dict(m) for m in edited]
    typed[4] = {**typed[4], "tool_calls": _tc({"x": 1.0})}
    message_chain(edited, None, memo)
    assert message_chain(typed, None, memo) == _reference(typed, None)
    # other tools: nothing reused; a context reset: a short conversation
    assert message_chain(typed, [{"type": "function"}], memo) == _reference(
        typed, [{"type": "function"}]
    )
    short = [{"role": "user", "content": "again"}]
    assert message_chain(short, None, memo) == _reference(short, None)
