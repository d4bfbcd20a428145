"""What the gateway cannot honour, or what is not a valid call, is refused with a 400 naming
the parameter, and nothing is stored (issue 26 §3): sampling settings the engine does not
implement, and tools and messages that would be trained on as calls no harness could make.
Their neutral values, which clients send by default, are taken."""

from __future__ import annotations

import httpx
import openai
import pytest

from infra.engine.engine import Engine
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.chat import parse_output
from infra.gateway.gateway import Gateway
from storage.store import Store
from tests.infra.gateway.fixtures import serving

pytestmark = pytest.mark.integration

USER = {"role": "user", "content": "hi"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def _tool(**fn) -> dict:
    return {"type": "function", "function": {"name": "f", **fn}}


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    model_dir = make_tiny_model()
    tmp = tmp_path_factory.mktemp("refused")
    with serving({"a": Engine(model_dir, cell_id="a")}) as urls:
        gw = Gateway(
            Store(str(tmp / "store")),
            run_id="run-r",
            tokenizer_dir=model_dir,
            spool_dir=str(tmp / "spool"),
        )
        gw.add_engine("a", urls["a"])
        gw.start()
        try:
            yield gw
        finally:
            gw.stop()


def _post(gw: Gateway, path: str, body: dict) -> httpx.Response:
    _, key = gw.new_session()
    auth = {"Authorization": f"Bearer {key}"}
    return httpx.post(gw.url + path, json=body, headers=auth, timeout=60)


CHAT = [
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"repetition_penalty": 1.3}, "repetition_penalty"),
    ({"min_p": 0.05}, "min_p"),
    ({"parallel_tool_calls": False, "tools": [_tool()]}, "parallel_tool_calls"),
    ({"tools": [_tool(parameters="{}")]}, "tools[0].function.parameters"),
    ({"tools": [_tool(parameters=[])]}, "tools[0].function.parameters"),
    ({"tools": [_tool(parameters={"type": "string"})]}, "tools[0].function.parameters.type"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
    ({"tools": [_tool(), _tool(name="")]}, "tools[1].function.name"),
    ({"tools": [{"type": "banana", "function": {"name": "f"}}]}, "tools[0].type"),
    (
        {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{not json"}}],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        {
            "messages": [
                USER,
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                USER,
                {"role": "tool", "content": "r"},
            ]
        },
        "messages[3].tool_call_id",
    ),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
]


@pytest.mark.parametrize(("extra", "param"), CHAT, ids=[p for _, p in CHAT])
def test_chat_refuses_and_stores_nothing(gw, extra, param):
    calls = gw.counters["calls"]
    body = {"model": "gyre", "messages": [USER], "max_tokens": 2, **extra}
    r = _post(gw, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert param.rsplit(".", 1)[-1].split("[")[0] in err["message"]
    assert gw.counters["calls"] == calls


NATIVE = [
    ({"n": 1000}, "sampling_params.n"),
    ({"presence_penalty": 0.5}, "sampling_params.presence_penalty"),
    ({"min_p": 0.1}, "sampling_params.min_p"),
    ({"regex": "a+"}, "sampling_params.regex"),
]


@pytest.mark.parametrize(("sp", "param"), NATIVE, ids=[p for _, p in NATIVE])
def test_generate_refuses_and_stores_nothing(gw, sp, param):
    calls = gw.counters["calls"]
    r = _post(gw, "/generate", {"input_ids": [1, 2, 3], "sampling_params": sp})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert gw.counters["calls"] == calls


def test_completions_and_responses_refuse_too(gw):
    r = _post(gw, "/v1/completions", {"model": "gyre", "prompt": "x", "frequency_penalty": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frequency_penalty"
    body = {"model": "gyre", "input": "x", "parallel_tool_calls": False}
    r = _post(gw, "/v1/responses", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "parallel_tool_calls"
    tool = {"type": "function", "name": "get weather", "parameters": {"type": "object"}}
    r = _post(gw, "/v1/responses", {"model": "gyre", "input": "x", "tools": [tool]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].name"
    tool = {"type": "function", "name": "f", "parameters": "{}"}
    r = _post(gw, "/v1/responses", {"model": "gyre", "input": "x", "tools": [tool]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].parameters"


def test_neutral_values_and_valid_tool_turns_are_taken(gw):
    """What clients send by default (the openai client sends what it is given; SDKs send the
    neutral values), and a real tool turn: assistant content null with tool calls, then the
    tool's answer with its call id."""
    _, key = gw.new_session()
    cl = openai.OpenAI(base_url=gw.openai_base_url, api_key=key, max_retries=0)
    msgs = [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "r"}]  # fmt: skip
    tools = [_tool(parameters={"type": "object", "properties": {"a": {"type": "integer"}}})]
    r = cl.chat.completions.create(
        model="gyre",
        messages=msgs,
        tools=tools,
        max_tokens=2,
        presence_penalty=0,
        frequency_penalty=0.0,
        logit_bias={},
        parallel_tool_calls=True,
        n=1,
        extra_body={"repetition_penalty": 1.0, "min_p": 0.0},
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = _post(
        gw,
        "/generate",
        {"input_ids": [1, 2], "sampling_params": {"n": 1, "min_p": 0, "max_new_tokens": 2}},
    )
    assert r.status_code == 200, r.text


def test_a_tool_call_whose_arguments_are_not_json_is_text():
    """The gateway never answers a tool call it would refuse when the harness sends it back."""
    text = '<tool_call>{"name": "bash", "arguments": "ls -la"}</tool_call>'
    assert parse_output(text) == (text, [])
    content, calls = parse_output(
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    )
    assert content is None and calls[0]["function"]["arguments"] == '{"a": 1}'
