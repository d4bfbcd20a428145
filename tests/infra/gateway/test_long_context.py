"""The gateway at long context: the chat chain keys are incremental (earlier messages are
not re-hashed) and still name exactly what the template sees, branches included."""

from __future__ import annotations

import hashlib

import httpx
import openai
import orjson
import pytest

from infra.engine.tiny_model import make_tiny_model
from infra.gateway.call_index import ChainMemo
from infra.gateway.chat import message_chain
from infra.gateway.gateway import Gateway
from storage.store import Store
from storage.tito import reconstruct_inputs
from storage.tito_log import table_to_records
from tests.infra.gateway.fixtures import ScriptedEngine, exact_records, serving


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


@pytest.fixture(scope="module")
def served():
    model_dir = make_tiny_model()
    eng = ScriptedEngine(model_dir, cell_id="a")
    with serving({"a": eng}) as urls:
        yield model_dir, eng, urls["a"]


@pytest.mark.integration
def test_long_session_through_prefix_handles_is_token_exact_and_branches(tmp_path, served):
    """40 chat calls, each re-sending the whole conversation: the engine gets a prefix handle
    plus the new ids (yet receives exactly the ids TITO rebuilds); an edited earlier message
    and a context reset are branches, still exact."""
    model_dir, eng, url = served
    gw = Gateway(
        Store(str(tmp_path / "store")),
        run_id="run-t",
        tokenizer_dir=model_dir,
        spool_dir=str(tmp_path / "spool"),
    )
    gw.add_engine("a", url)
    gw.start()
    try:
        sid, key = gw.new_session()
        cl = openai.OpenAI(base_url=gw.openai_base_url, api_key=key, max_retries=0, timeout=60)
        msgs: list[dict] = [{"role": "system", "content": "be brief"}]
        n = 40
        for i in range(n):
            msgs.append({"role": "user", "content": f"step {i}: " + "word " * 20})
            r = cl.chat.completions.create(model=gw.model_name, messages=msgs, max_tokens=4)
            msgs.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        recs = exact_records(gw, sid, eng)
        assert len(recs) == n
        assert gw.counters["prefix_handles"] >= n - 1
        # every body after the first parsed from where the one before ended
        assert gw.counters["chat_tail_parses"] == n - 1
        # a bad new message on that session: the full parse's 400, as on a fresh session
        body = {"model": gw.model_name, "messages": [*msgs, {"content": "x"}], "max_tokens": 4}
        url = gw.openai_base_url + "/chat/completions"
        got = httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
        fresh = gw.new_session()[1]
        want = httpx.post(url, json=body, headers={"Authorization": f"Bearer {fresh}"})
        assert got.status_code == want.status_code == 400 and got.json() == want.json()
        assert got.json()["error"]["param"] == f"messages[{len(msgs)}].role"
        edited = [dict(m) for m in msgs]
        edited[3] = {**edited[3], "content": "changed"}
        cl.chat.completions.create(model=gw.model_name, messages=edited[:-1], max_tokens=4)
        cl.chat.completions.create(model=gw.model_name, messages=msgs[:2], max_tokens=4)
        gw.flush()
        recs = sorted(
            (r for r in table_to_records(gw.store.read("tito")) if r.session_id == sid),
            key=lambda r: r.seq_no,
        )
        full = reconstruct_inputs(recs)
        for r in recs:
            assert full[r.request_id].tolist() == eng.received[r.request_id]
        branch, reset = recs[-2], recs[-1]
        assert branch.prefix_len < len(full[recs[-3].request_id])  # shares only up to the edit
        assert reset.prefix_len < len(full[recs[1].request_id])
    finally:
        gw.stop()


@pytest.mark.integration
def test_a_large_sessions_next_turn_is_built_on_the_loop_and_a_branch_off_it(
    tmp_path, served, monkeypatch
):
    """Past OFFLOAD_TOKENS, a call whose new messages extend the last one is built from them
    alone on the event loop (no thread hop: its work does not grow with the session); a
    branch, which renders the whole conversation, still goes to a worker thread."""
    from infra.gateway import pipeline

    monkeypatch.setattr(pipeline, "OFFLOAD_TOKENS", 50)  # "large" from the second call on
    model_dir, eng, url = served
    gw = Gateway(Store(str(tmp_path / "store")), run_id="run-l", tokenizer_dir=model_dir,
                 spool_dir=str(tmp_path / "spool"))  # fmt: skip
    gw.add_engine("a", url)
    gw.start()
    try:
        sid, key = gw.new_session()
        cl = openai.OpenAI(base_url=gw.openai_base_url, api_key=key, max_retries=0, timeout=60)
        msgs: list[dict] = [{"role": "system", "content": "be brief"}]
        for i in range(6):
            msgs.append({"role": "user", "content": f"step {i}: " + "word " * 20})
            r = cl.chat.completions.create(model=gw.model_name, messages=msgs, max_tokens=4)
            msgs.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        assert gw.counters["chat_tail_parses"] == 5 and gw.counters["builds_off_loop"] == 0
        assert len(exact_records(gw, sid, eng)) == 6  # token-exact, each extending the last
        edited = [dict(m) for m in msgs]
        edited[1] = {**edited[1], "content": "changed"}
        cl.chat.completions.create(model=gw.model_name, messages=edited[:-1], max_tokens=4)
        assert gw.counters["builds_off_loop"] == 1
        gw.flush()
        recs = [r for r in table_to_records(gw.store.read("tito")) if r.session_id == sid]
        full = reconstruct_inputs(recs)
        assert len(recs) == 7 and all(full[r.request_id].tolist() == eng.received[r.request_id]
                                      for r in recs)  # fmt: skip
    finally:
        gw.stop()
