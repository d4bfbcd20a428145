"""The OpenAI Responses API on the gateway: the official client and the openai-agents SDK's
default model path, unmodified, against real engines; recorded as TITO like chat calls."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import openai
import pytest

from infra.engine.server import EngineServer
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.gateway import Gateway
from storage.sql import query
from storage.store import Store
from storage.tito import reconstruct_inputs
from storage.tito_log import table_to_records
from tests.infra.gateway.fixtures import ScriptedEngine

pytestmark = pytest.mark.integration

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def model_dir():
    return make_tiny_model()


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = ScriptedEngine(model_dir, cell_id="a")
    srv = EngineServer(eng)
    url = srv.start()
    yield eng, url
    srv.stop()
    eng.close()


@pytest.fixture
def gw(tmp_path, engine, model_dir):
    eng, url = engine
    eng.replies.clear()
    g = Gateway(
        Store(str(tmp_path / "store")),
        run_id="run-r",
        tokenizer_dir=model_dir,
        spool_dir=str(tmp_path / "spool"),
    )
    g.add_engine("a", url)
    g.start()
    yield g
    g.stop()


def _records(gw: Gateway, sid: str):
    gw.flush()
    return sorted(
        (r for r in table_to_records(gw.store.read("tito")) if r.session_id == sid),
        key=lambda r: r.seq_no,
    )


def _check_exact(recs, eng):
    full = reconstruct_inputs(recs)
    for r in recs:
        assert full[r.request_id].tolist() == eng.received[r.request_id]
        assert list(r.output_ids) == list(eng.requests[r.request_id].output_ids)
    return full


def _weather_call(client: openai.OpenAI, eng, tok):
    """The scenario's first call: the model calls ``get_weather``; returns that response,
    its function call and the tool's output item for the next call."""
    eng.replies.append(tok.encode(CALL))
    r1 = client.responses.create(
        model="gyre", instructions="Be brief.", input="Weather in Paris?", tools=[TOOL]
    )
    (fc,) = [o for o in r1.output if o.type == "function_call"]
    out = {"type": "function_call_output", "call_id": fc.call_id, "output": '{"sky": "sunny"}'}
    return r1, fc, out


def test_tool_call_then_previous_response_id_extends_exactly(gw, engine):
    eng, _ = engine
    sid, key = gw.new_session()
    client = openai.OpenAI(base_url=gw.openai_base_url, api_key=key, max_retries=0)
    r1, fc, out = _weather_call(client, eng, gw.tok)
    assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris"}
    eng.replies.append(gw.tok.encode("Sunny."))
    r2 = client.responses.create(
        model="gyre",
        instructions="Be brief.",
        previous_response_id=r1.id,
        input=[out],
        tools=[TOOL],
    )
    assert r2.output_text == "Sunny." and r2.usage.output_tokens >= 1
    # streamed, continuing r2
    eng.replies.append(gw.tok.encode("Bye now."))
    events = list(
        client.responses.create(
            model="gyre",
            instructions="Be brief.",
            previous_response_id=r2.id,
            input="Thanks!",
            tools=[TOOL],  # the same tools: a different set renders a different prefix
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Bye now." == events[-1].response.output_text
    r3 = events[-1].response
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gyre", previous_response_id="resp-nope", input="x")

    recs = _records(gw, sid)
    assert [r.request_id for r in recs] == [r1.id, r2.id, r3.id]
    assert {r.endpoint for r in recs} == {"responses"}
    full = _check_exact(recs, eng)
    for prev, cur in itertools.pairwise(recs):  # each call extends the previous
        assert cur.parent_request_id == prev.request_id
        assert cur.prefix_len == len(full[prev.request_id]) + len(prev.output_ids)


def test_openai_agents_sdk_default_model_runs_against_the_gateway(gw, engine):
    agents = pytest.importorskip("agents")
    eng, _ = engine
    sid, key = gw.new_session()
    agents.set_tracing_disabled(True)  # tracing would export to api.openai.com
    agents.set_default_openai_client(
        openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key=key, max_retries=0),
        use_for_tracing=False,
    )
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather of a city."""
        seen.append(city)
        return f"sunny in {city}"

    eng.replies.append(gw.tok.encode(CALL))
    eng.replies.append(gw.tok.encode("It is sunny."))
    agent = agents.Agent(
        name="weather", instructions="Answer briefly.", model="gyre", tools=[get_weather]
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?")
    assert seen == ["Paris"] and result.final_output == "It is sunny."
    recs = _records(gw, sid)
    assert len(recs) == 2 and {r.endpoint for r in recs} == {"responses"}
    full = _check_exact(recs, eng)
    # the SDK resends the whole conversation: the second call still extends the first exactly
    assert recs[1].parent_request_id == recs[0].request_id
    assert recs[1].prefix_len == len(full[recs[0].request_id]) + len(recs[0].output_ids)


def test_what_gyre_cannot_honour_is_refused_not_ignored(gw, engine):
    """A forced tool call, a constrained output format and reasoning settings get a 400
    naming the parameter (on Chat and Responses), never a silent answer without them; and
    nothing is recorded for them."""
    sid, key = gw.new_session()
    client = openai.OpenAI(base_url=gw.openai_base_url, api_key=key, max_retries=0)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    chat_tool = {"type": "function", "function": {k: TOOL[k] for k in ("name", "parameters")}}
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    for kwargs, param in (
        ({"tools": [chat_tool], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [chat_tool], "tool_choice": {"type": "function",
                                                "function": {"name": "get_weather"}}},
         "tool_choice"),
        ({"response_format": schema}, "response_format"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="gyre", messages=msgs, max_tokens=4, **kwargs)
        assert err.value.body["param"] == param and "not supported" in err.value.body["message"]
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}
    for kwargs, param in (
        ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
        ({"text": fmt}, "text.format"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model="gyre", input="Weather in Paris?", **kwargs)
        assert err.value.body["param"] == param, err.value.body
    assert _records(gw, sid) == []
    # what gyre does honour still works: auto tools, plain text format, no reasoning
    ok = client.responses.create(
        model="gyre", input="Hi", text={"format": {"type": "text"}}, max_output_tokens=4,
        reasoning={"effort": None}, tool_choice="auto", tools=[TOOL],
    )  # fmt: skip
    assert ok.status in ("completed", "incomplete")


def test_developer_role_is_the_system_prompt_on_chat_and_responses(gw, engine):
    eng, _ = engine
    seen = []
    for role, api in (("system", "chat"), ("developer", "chat"), ("developer", "responses")):
        sid, key = gw.new_session()
        client = openai.OpenAI(base_url=gw.openai_base_url, api_key=key, max_retries=0)
        msgs = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        if api == "chat":
            client.chat.completions.create(model="gyre", messages=msgs, max_tokens=2)
        else:
            client.responses.create(model="gyre", input=msgs, max_output_tokens=2)
        (rec,) = _records(gw, sid)
        seen.append(eng.received[rec.request_id])
    assert seen[0] == seen[1] == seen[2]


def _start(store, spool, model_dir, url, **kw) -> Gateway:
    g = Gateway(store, run_id="run-r", tokenizer_dir=model_dir, spool_dir=spool, **kw)
    g.add_engine("a", url)
    g.start()
    return g


def test_a_chain_and_get_survive_a_gateway_crash(tmp_path, engine, model_dir):
    """``previous_response_id`` and ``GET /v1/responses/{id}`` after a restart: the chain
    continues token-exactly and GET returns the objects the POSTs did (streamed one too)."""
    eng, url = engine
    eng.replies.clear()
    store, spool = Store(str(tmp_path / "store")), str(tmp_path / "spool")
    gw1 = _start(store, spool, model_dir, url, flush_seconds=3600, flush_records=10**6)
    sid, key = gw1.new_session()
    client = openai.OpenAI(base_url=gw1.openai_base_url, api_key=key, max_retries=0)
    r1, _, out = _weather_call(client, eng, gw1.tok)
    eng.replies.append(gw1.tok.encode("Sunny."))
    events = list(
        client.responses.create(
            model="gyre", instructions="Be brief.", previous_response_id=r1.id,
            input=[out], tools=[TOOL], stream=True,
        )
    )  # fmt: skip
    r2 = events[-1].response
    assert client.responses.retrieve(r1.id) == r1  # before the restart too
    _, key_b = gw1.new_session()  # a session whose first call after the restart is a GET
    client_b = openai.OpenAI(base_url=gw1.openai_base_url, api_key=key_b, max_retries=0)
    b1 = client_b.responses.create(model="gyre", input="Hi", max_output_tokens=3)
    assert store.read("tito").num_rows == 0  # the records are in the WAL only
    gw1.stop(flush=False)  # a crash

    gw2 = _start(store, spool, model_dir, url)
    try:
        client = openai.OpenAI(base_url=gw2.openai_base_url, api_key=key, max_retries=0)
        eng.replies.append(gw2.tok.encode("Bye."))
        r3 = client.responses.create(
            model="gyre", instructions="Be brief.", previous_response_id=r2.id,
            input="Thanks!", tools=[TOOL],
        )  # fmt: skip
        assert r3.output_text == "Bye."
        for rid, r in ((r1.id, r1), (r2.id, r2), (r3.id, r3)):
            assert client.responses.retrieve(rid) == r
        client_b = openai.OpenAI(base_url=gw2.openai_base_url, api_key=key_b, max_retries=0)
        assert client_b.responses.retrieve(b1.id) == b1
        recs = _records(gw2, sid)
    finally:
        gw2.stop()
    assert [r.request_id for r in recs] == [r1.id, r2.id, r3.id]
    full = _check_exact(recs, eng)
    prev, cur = recs[1], recs[2]  # the call after the restart extends the one before it
    assert cur.parent_request_id == prev.request_id
    assert cur.prefix_len == len(full[prev.request_id]) + len(prev.output_ids)


def test_get_response_of_another_session_or_unknown_id_is_404(gw, engine):
    eng, _ = engine
    _, key_a = gw.new_session()
    _, key_b = gw.new_session()
    a = openai.OpenAI(base_url=gw.openai_base_url, api_key=key_a, max_retries=0)
    b = openai.OpenAI(base_url=gw.openai_base_url, api_key=key_b, max_retries=0)
    eng.replies.append(gw.tok.encode("Hello."))
    r = a.responses.create(model="gyre", input="Hi", max_output_tokens=4)
    assert a.responses.retrieve(r.id) == r
    for client, rid in ((b, r.id), (a, "resp-nope")):
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.retrieve(rid)
        body = err.value.body
        assert set(body) == {"message", "type", "param", "code"} and rid in body["message"]
    with pytest.raises(openai.NotFoundError):  # nor can b continue a's chain
        b.responses.create(model="gyre", input="x", previous_response_id=r.id)


def test_request_json_holds_the_request_as_the_harness_sent_it(gw, engine):
    """The ``calls`` view's ``request_json``: a chat call's messages and tools as sent (after
    the first call, the messages it added since the call it extends), a Responses call's
    input, instructions, tools and previous_response_id."""
    eng, _ = engine
    sid, key = gw.new_session()
    client = openai.OpenAI(base_url=gw.openai_base_url, api_key=key, max_retries=0)
    tools = [{"type": "function", "function": {k: TOOL[k] for k in ("name", "parameters")}}]
    msgs = [
        {"role": "system", "content": "Be brief.", "name": "rules"},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    eng.replies.append(gw.tok.encode(CALL))
    c1 = client.chat.completions.create(model="gyre", messages=msgs, tools=tools)
    reply = c1.choices[0].message.model_dump(exclude_none=True)
    tool_turn = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "sun"}
    msgs2 = [*msgs, reply, tool_turn]
    eng.replies.append(gw.tok.encode("Sunny."))
    c2 = client.chat.completions.create(model="gyre", messages=msgs2, tools=tools)
    eng.replies.append(gw.tok.encode("Hi."))
    r1 = client.responses.create(model="gyre", instructions="Be kind.", input="Hello")
    gw.flush()
    rows = query(
        gw.store,
        f"SELECT request_id, request_json FROM calls WHERE session_id = '{sid}' ORDER BY seq_no",
    ).to_pylist()
    got = [(r["request_id"], json.loads(r["request_json"])) for r in rows]
    assert got == [
        (c1.id, {"messages": msgs, "tools": tools}),
        (c2.id, {"after": c1.id, "messages": [reply, tool_turn], "tools": tools}),
        (r1.id, {"input": "Hello", "instructions": "Be kind."}),
    ]
    # README's query for a call's whole message list gives what the client sent
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    (whole,) = [q for q in readme.split(";") if "WITH RECURSIVE" in q]
    (row,) = query(gw.store, whole.replace("chatcmpl-...", c2.id)).to_pylist()
    assert json.loads(row["messages"]) == msgs2
    (per_call,) = [q for q in readme.split(";") if "AS extends" in q]
    rows = query(gw.store, per_call.replace("sess-...", sid)).to_pylist()
    assert [(r["extends"], json.loads(r["messages"])) for r in rows[:2]] == [
        (None, msgs),
        (c1.id, [reply, tool_turn]),
    ]
