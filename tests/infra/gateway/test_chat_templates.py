"""The text a new turn adds after a reply (`ChatTokenizer.suffix_after_reply`), on templates
of every kind the self-check must tell apart: message-local ones (rendered from a short
probe, one render or two) and ones whose turns depend on the history (the whole history
rendered). Whatever the path, the suffix is the textbook one: the full conversation's
rendering with the rendering up to the reply's end marker cut off. And the fast paths are
taken where they are right (a ~1M-token session must not re-render its history per turn)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from infra.gateway.chat import ChatInputError, ChatTokenizer
from tests.infra.gateway.fixtures import SMOL_TEMPLATE, tokenizer_with_template


def _template(*, number: str = "", call_blocks: bool = False, inline_tools: bool = False) -> str:
    """A chatml template that renders what it is given strictly: string concatenation (a
    missing field raises), an unknown role raises, tools listed in the system turn.
    ``number``: a jinja test under which each turn's header carries its position (a template
    whose turns depend on the history); ``call_blocks``: each tool call in its own closed
    assistant block (a reply that renders with several end markers); ``inline_tools``: the
    tools repeated in each user turn (text after a reply that depends on the tools)."""
    num = f"{{% if {number} %}}{{{{ '[' ~ loop.index ~ ']' }}}}{{% endif %}}" if number else ""
    if call_blocks:
        calls = (
            "{{ '<|im_end|>\n' }}{% for tc in m.tool_calls %}"
            "{{ '<|im_start|>assistant\n<tool_call>' + tc.function.name + ' ' "
            "+ (tc.function.arguments | tojson) + '</tool_call><|im_end|>\n' }}{% endfor %}"
        )
    else:
        calls = (
            "{% for tc in m.tool_calls %}{{ '<tool_call>' + tc.function.name + ' ' "
            "+ (tc.function.arguments | tojson) + '</tool_call>' }}{% endfor %}"
            "{{ '<|im_end|>\n' }}"
        )
    user_tools = (
        "{% if tools %}{{ ' TOOLS ' + (tools | tojson) }}{% endif %}" if inline_tools else ""
    )
    return (
        "{% if tools %}{{ '<|im_start|>system\n' }}{% if messages and messages[0].role == 'system' %}"
        "{{ messages[0].content + '\n' }}{% endif %}{{ 'TOOLS ' + (tools | tojson) + "
        "'<|im_end|>\n' }}{% elif messages and messages[0].role == 'system' %}"
        "{{ '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{% endif %}"
        "{% for m in messages %}"
        "{% if m.role == 'system' %}{% if not loop.first %}"
        "{{ raise_exception('a system turn must come first') }}{% endif %}"
        f"{{% elif m.role == 'user' %}}{{{{ '<|im_start|>user' }}}}{num}"
        f"{{{{ '\n' + m.content }}}}{user_tools}{{{{ '<|im_end|>\n' }}}}"
        f"{{% elif m.role == 'assistant' %}}{{{{ '<|im_start|>assistant' }}}}{num}"
        "{{ '\n' + m.content }}{% if m.tool_calls %}" + calls + "{% else %}"
        "{{ '<|im_end|>\n' }}{% endif %}"
        f"{{% elif m.role == 'tool' %}}{{{{ '<|im_start|>tool' }}}}{num}"
        "{{ '\n' + m.content + '<|im_end|>\n' }}"
        "{% else %}{{ raise_exception('unknown role ' + m.role) }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )


# a template with no tool section and no system turn (it drops one silently): tools refused
DROPS_SYSTEM = (
    "{% for m in messages %}{% if m.role != 'system' %}"
    "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# name -> (template, message-local, one-render suffix)
TEMPLATES = {
    "strict": (_template(), True, True),
    "call-blocks": (_template(call_blocks=True), True, False),
    "inline-tools": (_template(inline_tools=True), True, True),
    "drops-system": (DROPS_SYSTEM, True, True),
    "call-blocks-inline-tools": (_template(call_blocks=True, inline_tools=True), True, False),
    "smol": (SMOL_TEMPLATE, True, False),  # a default system turn when none is given
    "numbered": (_template(number="true"), False, False),
    "numbered-after-system": (_template(number="messages[0].role == 'system'"), False, False),
    "numbered-with-tools": (_template(number="tools"), False, False),
    "numbered-tool-turns": (_template(number="m.role == 'tool'"), False, False),
}

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def _call(name: str, args: str) -> dict:
    return {"id": f"c-{name}", "type": "function", "function": {"name": name, "arguments": args}}


def _conversations() -> list[list[dict]]:
    calls = [_call("add", '{"a": 1, "b": 2}'), _call("mul", '{"a": 3}')]
    body = [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "use the tools"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c-add", "content": "3"},
        {"role": "tool", "tool_call_id": "c-mul", "content": "9"},
        {"role": "assistant", "content": "3 and 9"},
        {"role": "user", "content": "thanks"},
    ]
    return [[{"role": "system", "content": "be brief"}, *body], body]


@pytest.fixture(scope="module", params=list(TEMPLATES))
def case(request, tmp_path_factory) -> tuple[ChatTokenizer, bool, bool]:
    template, local, fast = TEMPLATES[request.param]
    tok = ChatTokenizer(tokenizer_with_template(tmp_path_factory.mktemp(request.param), template))
    return tok, local, fast


def _textbook_suffix(tok: ChatTokenizer, msgs: list[dict], k: int, tools) -> str:
    """The whole conversation rendered, less its rendering up to messages[k]'s end marker."""
    full = tok.render(msgs, tools, True)
    upto = tok.render(msgs[: k + 1], tools, False)
    assert full.startswith(upto)
    return full[upto.rindex(tok.im_end) :]


def test_the_self_check_takes_the_fast_paths_only_where_they_are_right(case):
    tok, local, fast = case
    assert (tok.message_local, tok.fast_suffix) == (local, fast)


def test_the_text_after_each_reply_is_the_textbook_suffix(case):
    tok, _, _ = case
    tool_sets = (None,) if tok.shows.mode == "refused" else (None, TOOLS)
    checked = 0
    for msgs in _conversations():
        for tools in tool_sets:
            for k, m in enumerate(msgs):
                if m["role"] == "assistant":
                    want = _textbook_suffix(tok, msgs, k, tools)
                    assert tok.suffix_after_reply(msgs, k, tools) == want, (k, tools)
                    checked += 1
    assert checked >= 6


def test_a_prompt_ends_with_the_assistant_header(case):
    tok, _, _ = case
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.render(msgs, None, True).endswith("<|im_start|>assistant\n")
    assert not tok.render(msgs, None, False).endswith("<|im_start|>assistant\n")


def test_the_fallback_renderer_renders_what_the_compiled_template_does(case, monkeypatch):
    # without transformers' private compiled template, its public apply_chat_template
    tok, _, _ = case
    tool_sets = (None,) if tok.shows.mode == "refused" else (None, TOOLS)
    want = [
        tok.render(msgs, tools, gen)
        for msgs in _conversations()
        for tools in tool_sets
        for gen in (False, True)
    ]
    monkeypatch.setattr(tok, "_template", None)
    got = [
        tok.render(msgs, tools, gen)
        for msgs in _conversations()
        for tools in tool_sets
        for gen in (False, True)
    ]
    assert got == want
    if "a system turn must come first" in tok.hf.chat_template:  # and fails as it does
        with pytest.raises(ChatInputError, match="with the chat template: a system turn must"):
            tok.render([{"role": "system", "content": "s"}] * 2, None, True)


def test_tools_on_a_template_with_no_place_for_them_are_refused_naming_tools(tmp_path):
    tok = ChatTokenizer(tokenizer_with_template(tmp_path, DROPS_SYSTEM))
    with pytest.raises(ChatInputError, match="no tool section and no system turn") as err:
        tok.render([{"role": "user", "content": "hi"}], TOOLS, True)
    assert err.value.param == "tools"


@pytest.mark.parametrize(
    ("template", "says"),
    [
        (SMOL_TEMPLATE, "tools are rendered in gyre's system-prompt format"),
        (DROPS_SYSTEM, "tools are refused (400): it has no system turn either"),
    ],
)
def test_a_template_without_a_tool_section_is_reported(tmp_path, caplog, template, says):
    where = tokenizer_with_template(tmp_path, template)
    with caplog.at_level(logging.INFO, logger="infra.gateway.chat"):
        ChatTokenizer(where)
    lines = [r.getMessage() for r in caplog.records if r.name == "infra.gateway.chat"]
    assert lines == [f"the chat template in {where} has no tool section: {says}"]


def test_a_template_with_a_tool_section_is_not_reported(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="infra.gateway.chat"):
        ChatTokenizer(tokenizer_with_template(tmp_path, _template()))
    assert not [r for r in caplog.records if r.name == "infra.gateway.chat"]


def test_the_suffix_is_rendered_from_the_reply_on_where_the_template_allows(case, monkeypatch):
    # a message-local template never re-renders the history before the reply (a ~1M-token
    # session's turn costs its new messages, not its length); another renders it all
    tok, local, _ = case
    msgs = _conversations()[0]
    k = max(i for i, m in enumerate(msgs) if m["role"] == "assistant" and i < len(msgs) - 2)
    sizes: list[int] = []
    real = tok.render

    def render(messages, tools, gen):
        sizes.append(len(messages))
        return real(messages, tools, gen)

    monkeypatch.setattr(tok, "render", render)
    tok.suffix_after_reply(msgs, k, None)
    assert sizes
    if local:
        assert max(sizes) <= 1 + len(msgs) - k  # the system turn + the reply on
    else:
        assert max(sizes) == len(msgs)


def _tokens_text(tok: ChatTokenizer, ids) -> str:
    return "".join(tok.token_str(int(t)) for t in ids)


def test_a_next_turn_extends_the_call_before_it_token_exactly(case):
    from infra.gateway.chat import (
        ContextTooLong,
        SessionCalls,
        build_chat_input,
        extend_chat_input,
        message_chain,
        parse_output,
        reply_key,
    )

    tok, local, _ = case
    tools = None if tok.shows.mode == "refused" else TOOLS
    calls = SessionCalls()
    m1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    inp1 = build_chat_input(tok, calls, m1, tools)
    assert inp1.mode == "branch"
    out = [*tok.encode("hello there"), tok.im_end_id]
    content, tcs = parse_output(tok.decode(out))
    calls.add(
        "r1", 0, inp1, np.asarray(out), reply=reply_key(content, tcs), im_end_id=tok.im_end_id
    )
    m2 = [*m1, {"role": "assistant", "content": content}, {"role": "user", "content": "more"}]
    inp2 = build_chat_input(tok, calls, m2, tools)
    ctx = [*inp1.input_ids.tolist(), *out]
    assert inp2.mode == "extend" and inp2.input_ids.tolist()[: len(ctx)] == ctx
    after = _textbook_suffix(tok, m2, 2, tools)[len(tok.im_end) :]  # the output holds it
    assert _tokens_text(tok, inp2.input_ids[len(ctx) :]) == after
    if local:  # its prompt's header is its history's: the whole text is the full rendering
        assert _tokens_text(tok, inp2.input_ids) == tok.render(m2, tools, True)
    with pytest.raises(ContextTooLong):  # the context before the new text counts
        build_chat_input(tok, calls, m2, tools, limit=len(ctx) + 2)
    # the gateway's path for a body that extends the last one: the same input from the new
    # messages alone (a message-local template only)
    key = message_chain(m1, tools)[-1]
    got = extend_chat_input(tok, calls, m1[0], len(m1), m2[len(m1) :], tools, key)
    if not local:
        assert got is None
        return
    assert got is not None and got.mode == "extend"
    assert got.input_ids.tolist() == inp2.input_ids.tolist()
    assert got.after == "r1" and got.after_at == len(m1)
    with pytest.raises(ContextTooLong):
        extend_chat_input(tok, calls, m1[0], len(m1), m2[len(m1) :], tools, key, limit=len(ctx) + 2)
