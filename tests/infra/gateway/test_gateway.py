"""The gateway end to end: the official openai client -> gateway -> real engine servers.

Checks token exactness against what the engines actually received, across tool calls, a
rollback branch, streaming and a cell withdrawal in the middle of a session.
"""

from __future__ import annotations

import itertools
import json
import threading
import time

import httpx
import openai
import pytest

from infra.engine.server import EngineServer
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.gateway import Gateway
from storage.store import Store
from storage.tito import common_prefix_len, reconstruct_inputs
from storage.tito_log import table_to_records
from tests.infra.gateway.fixtures import ScriptedEngine, serving

pytestmark = pytest.mark.integration

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def model_dir():
    return make_tiny_model()


@pytest.fixture(scope="module")
def cells(model_dir):
    """Two engine servers (cells a and b)."""
    engines = {c: ScriptedEngine(model_dir, cell_id=c) for c in ("a", "b")}
    with serving(engines) as urls:
        yield engines, urls


@pytest.fixture
def gateway(tmp_path, cells, model_dir):
    engines, urls = cells
    for e in engines.values():
        e.replies.clear()
    gw = Gateway(
        Store(str(tmp_path / "store")),
        run_id="run-t",
        tokenizer_dir=model_dir,
        spool_dir=str(tmp_path / "spool"),
        admin_token="admin-secret",
    )
    for c, u in urls.items():
        gw.add_engine(c, u)
    gw.start()
    yield gw
    gw.stop()


def _client(gw: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.openai_base_url, api_key=key, max_retries=0, timeout=60)


def _records(gw: Gateway, session_id: str | None = None):
    gw.flush()
    recs = table_to_records(gw.store.read("tito"))
    return [r for r in recs if session_id is None or r.session_id == session_id]


def _check_exact(recs, engines):
    """Every record's rebuilt input is what an engine received for that request id."""
    full = reconstruct_inputs(recs)
    received = {}
    outputs = {}
    for e in engines.values():
        received.update(e.received)
        outputs.update({rid: list(r.output_ids) for rid, r in e.requests.items()})
    for r in recs:
        rid = r.request_id
        if rid in received:
            assert full[rid].tolist() == received[rid], rid
        else:  # the first cell was unreachable: the retry elsewhere got the same input
            retry = min((k for k in received if k.startswith(rid + "-")), key=len)
            assert full[rid].tolist() == received[retry], rid
        if not any(k.startswith(rid + "-") for k in received):  # not continued
            assert list(r.output_ids) == outputs[r.request_id]
        assert len(r.output_logprobs) == len(r.output_ids)
    return full


def test_tool_conversation_exact_across_branch_and_withdrawal(gateway, cells):
    engines, _ = cells
    gw = gateway
    tok = gw.tok
    sid, key = gw.new_session(group_id="g0")
    client = _client(gw, key)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for e in engines.values():  # the session lands on either cell: script both
        e.replies.append(tok.encode(call))

    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    r1 = client.chat.completions.create(
        model="gyre", messages=msgs, tools=TOOLS, max_tokens=64, logprobs=True
    )
    m1 = r1.choices[0].message
    assert r1.choices[0].finish_reason == "tool_calls"
    assert m1.tool_calls[0].function.name == "get_weather"
    assert json.loads(m1.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert len(r1.choices[0].logprobs.content) == r1.usage.completion_tokens
    cell1 = gw.sessions.get(sid).cell_id
    for e in engines.values():
        e.replies.clear()
    engines[cell1].replies.append(tok.encode("It is sunny in Paris today."))

    msgs += [
        m1.model_dump(),  # the openai client's object, null fields included
        {"role": "tool", "tool_call_id": m1.tool_calls[0].id, "content": '{"sky": "sunny"}'},
    ]
    r2 = client.chat.completions.create(model="gyre", messages=msgs, tools=TOOLS, max_tokens=32)
    assert r2.choices[0].message.content == "It is sunny in Paris today."
    msgs += [
        r2.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "And tomorrow?"},
    ]
    r3 = client.chat.completions.create(
        model="gyre", messages=msgs, tools=TOOLS, max_tokens=6, temperature=0.7, seed=3
    )

    # withdraw the session's cell between two calls: the next call runs on the other cell
    info = gw.remove_engine(cell1)
    assert info["sessions_moved"] == 1 and info["kv_moves"] == 1 and info["kv_tokens"] > 0
    cell2 = gw.sessions.get(sid).cell_id
    assert cell2 != cell1 and cell1 not in gw.engines()
    msgs += [
        r3.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "Thanks."},
    ]
    stream = client.chat.completions.create(
        model="gyre",
        messages=msgs,
        tools=TOOLS,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    r4_id = chunks[0].id
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens >= 1

    # rollback: back to after the tool result, a different question (a branch)
    rb = [*msgs[:5], {"role": "user", "content": "Is it cold?"}]
    r5 = client.chat.completions.create(model="gyre", messages=rb, tools=TOOLS, max_tokens=4)

    recs = {r.request_id: r for r in _records(gw, sid)}
    ids = [r1.id, r2.id, r3.id, r4_id, r5.id]
    assert set(ids) == set(recs)
    full = _check_exact(list(recs.values()), engines)
    r = [recs[i] for i in ids]
    assert [x.seq_no for x in r] == [0, 1, 2, 3, 4]
    assert r[0].parent_request_id is None and r[0].prefix_len == 0
    for prev, cur in itertools.pairwise(r[:4]):  # each turn extends the previous one
        assert cur.parent_request_id == prev.request_id
        assert cur.prefix_len == len(full[prev.request_id]) + len(prev.output_ids)
    assert [x.cell_id for x in r[:3]] == [cell1] * 3 and r[3].cell_id == cell2
    # the moved KV: the last call's whole input (+ its output but the last token, whose KV the
    # engine never computed) served the next call's prefix on the new cell
    assert info["kv_tokens"] >= len(full[r3.id])
    assert r[3].cached_tokens >= len(full[r3.id])
    assert tok.decode(r[3].output_ids).startswith(content)
    # the branch extends r2 exactly; it shares r2's context + "\n<|im_start|>user\n" with
    # r3 and r4 too (ties go to the latest call)
    ctx2 = full[r2.id].tolist() + list(r[1].output_ids)
    assert full[r5.id].tolist()[: len(ctx2)] == ctx2
    assert r[4].parent_request_id == r4_id
    assert r[4].prefix_len == len(ctx2) + len(tok.encode("\n<|im_start|>user\n"))
    assert all(x.endpoint == "chat" and x.run_id == "run-t" for x in r)
    assert all(x.weight_version == 0 for x in r)
    # the rollout's unique tokens are far fewer than the flat sum
    uniq = sum(len(x.new_input_ids) + len(x.output_ids) for x in r)
    flat = sum(len(full[x.request_id]) + len(x.output_ids) for x in r)
    assert uniq < flat / 2


def test_inflight_call_on_withdrawn_cell_continues_elsewhere(gateway, cells):
    engines, _ = cells
    gw = gateway
    sid, key = gw.new_session()
    client = _client(gw, key)
    r0 = client.chat.completions.create(
        model="gyre", messages=[{"role": "user", "content": "Count."}], max_tokens=2
    )
    cell = gw.sessions.get(sid).cell_id
    other = "b" if cell == "a" else "a"
    long_reply = [300 + (i % 200) for i in range(400)]
    engines[cell].replies.append(long_reply)
    engines[other].replies.append(long_reply[::-1])
    result = {}

    def harness():
        msgs = [
            {"role": "user", "content": "Count."},
            r0.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "Again, longer."},
        ]
        result["r"] = client.chat.completions.create(model="gyre", messages=msgs, max_tokens=120)

    before = set(engines[cell].requests)
    t = threading.Thread(target=harness)
    t.start()
    deadline = time.time() + 30
    while time.time() < deadline:  # wait until the call is generating on its cell
        reqs = [q for rid, q in list(engines[cell].requests.items()) if rid not in before]
        if reqs and len(reqs[-1].output_ids) >= 3:
            break
        time.sleep(0.01)
    info = gw.remove_engine(cell, drain_timeout=0.05)
    t.join(60)
    assert info["aborted_inflight"] == 1
    r = result["r"]
    assert r.usage.completion_tokens == 120 and r.choices[0].finish_reason == "length"
    rec = {x.request_id: x for x in _records(gw, sid)}[r.id]
    partial = list(engines[cell].requests[r.id].output_ids)
    assert 0 < len(partial) < 120
    cont = engines[other].received[r.id + "-1"]
    full = reconstruct_inputs(_records(gw, sid))
    assert cont == full[r.id].tolist() + partial  # resubmitted: prefix + partial output
    assert list(rec.output_ids[: len(partial)]) == partial and rec.cell_id == other
    gw.add_engine(cell, cells[1][cell])  # back for the other tests


def test_streaming_tool_call_and_completions_and_generate(gateway, cells):
    engines, _ = cells
    gw = gateway
    tok = gw.tok
    sid, key = gw.new_session()
    client = _client(gw, key)
    call = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for e in engines.values():
        e.replies.append(tok.encode(call))
    stream = client.chat.completions.create(
        model="gyre",
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=TOOLS,
        max_tokens=64,
        stream=True,
        logprobs=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    tcs = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    n_lp = sum(
        len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs
    )
    assert text == "Checking."
    assert tcs[0].function.name == "get_weather" and json.loads(tcs[0].function.arguments) == {
        "city": "Oslo"
    }
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    for e in engines.values():
        e.replies.clear()

    comp = client.completions.create(model="gyre", prompt="Once upon a time", max_tokens=5)
    assert comp.id.startswith("cmpl-") and comp.usage.prompt_tokens == len(
        tok.encode("Once upon a time")
    )
    comp2 = client.completions.create(
        model="gyre", prompt=[*tok.encode("Once upon a time"), 5, 6], max_tokens=3, logprobs=0
    )
    assert len(comp2.choices[0].logprobs.token_logprobs) == comp2.usage.completion_tokens
    # streamed, logprobs=0: every chunk's tokens with their logprobs, none dropped
    comp_chunks = list(client.completions.create(
        model="gyre", prompt=[*tok.encode("Once upon a time"), 5, 6], max_tokens=6, logprobs=0,
        stream=True, stream_options={"include_usage": True},
    ))  # fmt: skip
    got = [c.choices[0].logprobs for c in comp_chunks if c.choices and c.choices[0].logprobs]
    n_out = next(c.usage for c in comp_chunks if c.usage).completion_tokens
    assert sum(len(lp.token_logprobs) for lp in got) == n_out > 0
    offsets = [o for lp in got for o in lp.text_offset]
    assert offsets == sorted(offsets) and offsets[0] == 0

    res = httpx.post(
        gw.url + "/generate",
        headers={"Authorization": f"Bearer {key}"},
        json={
            "input_ids": [*tok.encode("Once upon a time"), 5, 6, 7],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "return_logprob": True,
            "rid": "ignored",
        },
    )
    assert res.status_code == 200, res.text
    g = res.json()
    assert (
        g["meta_info"]["id"].startswith("gen-")
        and len(g["output_ids"]) == g["meta_info"]["completion_tokens"]
    )
    assert [t for _, t, _ in g["meta_info"]["output_token_logprobs"]] == g["output_ids"]

    recs = {r.request_id: r for r in _records(gw, sid)}
    assert n_lp == len(recs[chunks[0].id].output_ids)
    full = _check_exact(list(recs.values()), engines)
    rg = recs[g["meta_info"]["id"]]
    assert rg.endpoint == "generate"
    ctxs = {k: full[k].tolist() + list(v.output_ids) for k, v in recs.items() if k != rg.request_id}
    best = max(common_prefix_len(full[rg.request_id], c) for c in ctxs.values())
    assert rg.prefix_len == best >= len(tok.encode("Once upon a time")) + 2  # longest prefix
    assert common_prefix_len(full[rg.request_id], ctxs[rg.parent_request_id]) == best

    # scores against the call ids
    res = httpx.post(
        gw.url + "/gyre/scores",
        headers={"Authorization": f"Bearer {key}"},
        json={"subtask_id": "tests/a", "score": 0.5, "weight": 2, "at_request_id": comp.id},
    )
    assert res.status_code == 200, res.text
    sc = gw.store.read("scores").to_pylist()
    assert sc == [
        {
            "run_id": "run-t",
            "session_id": sid,
            "subtask_id": "tests/a",
            "score": 0.5,
            "weight": 2.0,
            "at_request_id": comp.id,
            "source": "harness",
            "status": "finished",
            "reason": "",
        }
    ]
    st = httpx.get(gw.url + "/gyre/stats", headers={"Authorization": "Bearer admin-secret"}).json()
    assert st["gateway/calls"] == 5 and set(st["engines"]) == {"a", "b"}


def _err(res: httpx.Response, status: int, code: str | None = None) -> dict:
    assert res.status_code == status, res.text
    err = res.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def test_isolation_and_bad_input_store_nothing(gateway, tmp_path, model_dir, cells):
    gw = gateway
    url = gw.url
    sid_a, key_a = gw.new_session()
    _sid_b, key_b = gw.new_session()
    ok = _client(gw, key_a).chat.completions.create(
        model="gyre", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    n0 = len(_records(gw))
    h_a = {"Authorization": f"Bearer {key_a}"}
    h_b = {"Authorization": f"Bearer {key_b}"}
    chat = url + "/v1/chat/completions"
    msg = [{"role": "user", "content": "Hi"}]

    # auth: missing, unknown, another session's call id, admin-only endpoints
    _err(httpx.post(chat, json={"model": "gyre", "messages": msg}), 401, "invalid_api_key")
    _err(
        httpx.post(
            chat, json={"model": "gyre", "messages": msg}, headers={"Authorization": "Bearer nope"}
        ),
        401,
    )
    with pytest.raises(openai.AuthenticationError):
        _client(gw, "gyre-not-a-key").chat.completions.create(model="gyre", messages=msg)
    score = {"subtask_id": "t", "score": 1.0, "at_request_id": ok.id}
    _err(httpx.post(url + "/gyre/scores", json=score, headers=h_b), 400)
    assert httpx.post(url + "/gyre/scores", json=score, headers=h_a).status_code == 200
    _err(httpx.post(url + "/gyre/sessions", json={}, headers=h_a), 401)
    _err(httpx.get(url + "/gyre/stats", headers=h_a), 401)
    made = httpx.post(
        url + "/gyre/sessions",
        json={"group_id": "g"},
        headers={"Authorization": "Bearer admin-secret"},
    )
    assert made.status_code == 200 and gw.sessions.by_key(made.json()["api_key"]).group_id == "g"

    # bad input, each a 4xx in OpenAI's error shape
    _err(httpx.post(chat, content=b"{not json", headers=h_a), 400, "invalid_json")
    _err(httpx.post(chat, content=b"[1, 2]", headers=h_a), 400, "invalid_json")
    _err(
        httpx.post(chat, json={"model": "gpt-x", "messages": msg}, headers=h_a),
        404,
        "model_not_found",
    )
    with pytest.raises(openai.NotFoundError):
        _client(gw, key_a).chat.completions.create(model="gpt-x", messages=msg)
    _err(httpx.post(chat, json={"model": "gyre", "messages": [{"content": "x"}]}, headers=h_a), 400)
    _err(httpx.post(chat, json={"model": "gyre", "messages": []}, headers=h_a), 400)
    _err(
        httpx.post(chat, json={"model": "gyre", "messages": msg, "temperature": 9}, headers=h_a),
        400,
    )
    _err(httpx.post(chat, json={"model": "gyre", "messages": msg, "n": 2}, headers=h_a), 400)
    _err(
        httpx.post(chat, json={"model": "gyre", "messages": msg, "top_logprobs": 3}, headers=h_a),
        400,
    )
    _err(
        httpx.post(chat, json={"model": "gyre", "messages": msg, "max_tokens": 10**6}, headers=h_a),
        400,
        "context_length_exceeded",
    )
    with pytest.raises(openai.BadRequestError):
        _client(gw, key_a).chat.completions.create(model="gyre", messages=msg, max_tokens=10**6)
    comp = url + "/v1/completions"
    _err(
        httpx.post(comp, json={"model": "gyre", "prompt": [1, 99999]}, headers=h_a),
        400,
        "invalid_token_id",
    )
    _err(
        httpx.post(comp, json={"model": "gyre", "prompt": [1, -1]}, headers=h_a),
        400,
        "invalid_token_id",
    )
    err = _err(httpx.post(url + "/generate", json={"input_ids": ["a"]}, headers=h_a), 400)
    assert err["param"] == "input_ids[0]"
    long = [5] * 40000  # over the tiny model's 32768-token context
    _err(
        httpx.post(url + "/generate", json={"input_ids": long}, headers=h_a),
        400,
        "context_length_exceeded",
    )
    _err(httpx.post(url + "/gyre/scores", json={"subtask_id": "t", "score": 2}, headers=h_a), 400)
    _err(httpx.post(url + "/v1/nope", json={}, headers=h_a), 404)
    big = gw.max_body_bytes
    gw.max_body_bytes = 10_000  # oversize bodies (limit lowered for the test)
    try:
        _err(
            httpx.post(
                chat,
                json={"model": "gyre", "messages": [{"role": "user", "content": "x" * 20_000}]},
                headers=h_a,
            ),
            413,
            "body_too_large",
        )
    finally:
        gw.max_body_bytes = big
    # unknown fields are ignored
    res = httpx.post(
        chat,
        json={
            "model": "gyre",
            "messages": msg,
            "max_tokens": 2,
            "frobnicate": {"x": 1},
            "user": "u",
        },
        headers=h_a,
    )
    assert res.status_code == 200, res.text
    recs = _records(gw)
    assert len(recs) == n0 + 1 and recs and {r.session_id for r in recs} == {sid_a}
    assert httpx.get(url + "/v1/models", headers=h_b).json()["data"][0]["id"] == "gyre"


def test_restart_mid_session_loses_no_answered_call(tmp_path, cells, model_dir):
    engines, urls = cells
    store = Store(str(tmp_path / "store"))
    spool = str(tmp_path / "spool")

    def start():
        gw = Gateway(
            store,
            run_id="run-d",
            tokenizer_dir=model_dir,
            spool_dir=spool,
            flush_seconds=3600,
            flush_records=10**6,
        )
        for c, u in urls.items():
            gw.add_engine(c, u)
        gw.start()
        return gw

    gw1 = start()
    _sid, key = gw1.new_session()
    client = _client(gw1, key)
    msgs = [{"role": "user", "content": "Start."}]
    answered = []
    for turn in range(3):
        r = client.chat.completions.create(model="gyre", messages=msgs, max_tokens=3)
        answered.append(r.id)
        msgs += [
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": f"Turn {turn}."},
        ]
    assert store.read("tito").num_rows == 0  # all still in the WAL only
    gw1.stop(flush=False)  # a crash: nothing flushed

    gw2 = start()  # same spool: replays the WAL, keeps the session keys
    assert sorted(store.read("tito").column("request_id").to_pylist()) == sorted(answered)
    client = _client(gw2, key)
    r = client.chat.completions.create(model="gyre", messages=msgs, max_tokens=3)
    gw2.stop()
    recs = {x.request_id: x for x in table_to_records(store.read("tito"))}
    assert set(recs) == {*answered, r.id}
    assert recs[r.id].seq_no == 3 and recs[r.id].parent_request_id == answered[-1]
    full = _check_exact(list(recs.values()), engines)
    prev = recs[answered[-1]]
    assert recs[r.id].prefix_len == len(full[prev.request_id]) + len(prev.output_ids)


def test_streamed_call_survives_withdrawal_and_dead_engine(gateway, cells, model_dir):
    """A stream in flight on a withdrawn cell continues elsewhere; a dead cell's session
    re-prefills on another cell. The harness sees neither."""
    engines, urls = cells
    gw = gateway
    sid, key = gw.new_session()
    client = _client(gw, key)
    r0 = client.chat.completions.create(
        model="gyre", messages=[{"role": "user", "content": "Go."}], max_tokens=2
    )
    cell = gw.sessions.get(sid).cell_id
    other = "b" if cell == "a" else "a"
    engines[cell].replies.append([300 + (i % 100) for i in range(400)])
    engines[other].replies.append([500 + (i % 100) for i in range(400)])
    msgs = [
        {"role": "user", "content": "Go."},
        r0.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "More."},
    ]
    stream = client.chat.completions.create(model="gyre", messages=msgs, max_tokens=80, stream=True)
    it = iter(stream)
    first = [next(it) for _ in range(4)]  # the call is generating on `cell`
    info = gw.remove_engine(cell, drain_timeout=0.01)
    rest = list(it)
    chunks = first + rest
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert info["aborted_inflight"] == 1 and chunks[-1].choices[0].finish_reason == "length"
    rec = {x.request_id: x for x in _records(gw, sid)}[chunks[0].id]
    assert len(rec.output_ids) == 80 and rec.cell_id == other
    assert gw.tok.decode(rec.output_ids) == text
    _check_exact(_records(gw, sid), engines)
    gw.add_engine(cell, urls[cell])

    # a third engine that dies without being withdrawn
    eng = ScriptedEngine(model_dir, cell_id="x")
    srv = EngineServer(eng)
    gw.add_engine("x", srv.start())
    sid2, key2 = gw.new_session()
    c2 = _client(gw, key2)
    gw.sessions.get(sid2).cell_id = "x"  # place the session on x (affinity does the rest)
    gw.router.engines["x"].sessions.add(sid2)
    r1 = c2.chat.completions.create(
        model="gyre", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert gw.sessions.get(sid2).cell_id == "x"
    srv.stop()
    eng.close()
    msgs2 = [
        {"role": "user", "content": "Hi"},
        r1.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "Still there?"},
    ]
    r2 = c2.chat.completions.create(model="gyre", messages=msgs2, max_tokens=2)
    recs = {x.request_id: x for x in _records(gw, sid2)}
    assert recs[r2.id].cell_id in ("a", "b") and recs[r2.id].parent_request_id == r1.id
    assert gw.engines()["x"]["state"] == "dead"
    _check_exact(list(recs.values()), {**engines, "x": eng})
    gw.remove_engine("x")


def test_streaming_completions_and_native_generate(gateway, cells):
    engines, _ = cells
    gw = gateway
    tok = gw.tok
    sid, key = gw.new_session()
    client = _client(gw, key)
    chunks = list(
        client.completions.create(
            model="gyre", prompt="The weather", max_tokens=6, stream=True, temperature=0.5, seed=1
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    body = {
        "input_ids": tok.encode("The weather today"),
        "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        "return_logprob": True,
        "stream": True,
    }
    events = []
    with httpx.stream(
        "POST", gw.url + "/generate", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as res:
        assert res.status_code == 200
        for line in res.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    last = events[-1]
    assert last["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert [t for _, t, _ in last["meta_info"]["output_token_logprobs"]] == last["output_ids"]
    recs = {r.request_id: r for r in _records(gw, sid)}
    assert tok.decode(recs[chunks[0].id].output_ids) == text
    assert list(recs[last["meta_info"]["id"]].output_ids) == last["output_ids"]
    assert recs[last["meta_info"]["id"]].endpoint == "generate"
    _check_exact(list(recs.values()), engines)


def test_withdrawal_moves_a_group_to_the_cell_the_scheduler_named(gateway, cells, model_dir):
    """The coordinator books a withdrawn cell's sessions on the cells its ``Move`` names: the
    gateway must send them there, not to the least-loaded cell (else the books drift: a cell
    over its cap, a cell with other weights)."""
    _, urls = cells
    gw = gateway
    extra = {"c": ScriptedEngine(model_dir, cell_id="c")}
    with serving(extra) as more:
        gw.add_engine("c", more["c"])
        s1, k1 = gw.new_session(group_id="g1", meta={"cell_id": "a"})
        s2, k2 = gw.new_session(group_id="g2", meta={"cell_id": "b"})  # b is busier than c
        s3, k3 = gw.new_session(group_id="g3", meta={"cell_id": "a"})
        for key in (k1, k2, k3):
            _client(gw, key).chat.completions.create(
                model="gyre", messages=[{"role": "user", "content": "Hi."}], max_tokens=2
            )
        assert [gw.sessions.get(s).cell_id for s in (s1, s2, s3)] == ["a", "b", "a"]
        info = gw.remove_engine("a", targets={"g1": "b"})
        assert info["sessions_moved"] == 2
        assert gw.sessions.get(s1).cell_id == "b"  # where the scheduler rerouted it
        assert gw.sessions.get(s3).cell_id == "c"  # not named: the least-loaded cell
        r = _client(gw, k1).chat.completions.create(
            model="gyre",
            messages=[{"role": "user", "content": "Hi."}, {"role": "user", "content": "More."}],
            max_tokens=2,
        )
        rec = {x.request_id: x for x in _records(gw, s1)}[r.id]
        assert rec.cell_id == "b"
        gw.remove_engine("c")
    gw.add_engine("a", urls["a"])  # back for the other tests
