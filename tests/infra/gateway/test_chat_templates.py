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

from infra.gateway.chat import (
    ChatInputError,
    ChatTokenizer,
    ContextTooLong,
    SessionCalls,
    build_chat_input,
    extend_chat_input,
    message_chain,
)
from tests.infra.gateway.fixtures import (
    SMOL_TEMPLATE,
    add_call,
    count_message_keys,
    tokenizer_with_template,
)


def _template(
    *, number: str = "", call_blocks: bool = False, inline_tools: bool = False, persona=False
) -> str:
    """A chatml template that renders what it is given strictly: string concatenation (a
    missing field raises), an unknown role raises, tools listed in the system turn.
    ``number``: a jinja test under which each turn's header carries its position (a template
    whose turns depend on the history); ``call_blocks``: each tool call in its own closed
    assistant block (a reply that renders with several end markers); ``inline_tools``: the
    tools repeated in each user turn (text after a reply that depends on the tools);
    ``persona``: each assistant header names the system prompt (turns that read messages[0],
    message-local only with the system turn in the probe)."""
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
    who = (
        "{% if messages[0].role == 'system' %}{{ ' (' + messages[0].content + ')' }}{% endif %}"
        if persona
        else ""
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
        f"{{% elif m.role == 'assistant' %}}{{{{ '<|im_start|>assistant' }}}}{who}{num}"
        "{{ '\n' + m.content }}{% if m.tool_calls %}" + calls + "{% else %}"
        "{{ '<|im_end|>\n' }}{% endif %}"
        f"{{% elif m.role == 'tool' %}}{{{{ '<|im_start|>tool' }}}}{num}"
        "{{ '\n' + m.content + '<|im_end|>\n' }}"
        "{% else %}{{ raise_exception('unknown role ' + m.role) }}{% endif %}{% endfor %}"
        f"{{% if add_generation_prompt %}}{{{{ '<|im_start|>assistant' }}}}{who}{{{{ '\n' }}}}"
        "{% endif %}"
    )


# a template with no tool section and no system turn (it drops one silently): tools refused
DROPS_SYSTEM = (
    "{% for m in messages %}{% if m.role != 'system' %}"
    "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# one that fails on a system turn: the self-check cannot probe it, and trusts it with nothing
RAISES_ON_SYSTEM = (
    "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
    "{% endif %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# no turn headers (contents and end markers only; a header for the prompt alone): an empty
# reply renders as its end marker alone, at position 0 of a probe's rendering
HEADERLESS = (
    "{% for m in messages %}{{ m.content + '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# the same with each tool call a closed block of its own (two renders per suffix)
HEADERLESS_CALL_BLOCKS = HEADERLESS.replace(
    "'<|im_end|>' }}",
    "'<|im_end|>' }}{% for tc in m.tool_calls or [] %}"
    "{{ '<tool_call>' + tc.function.name + '</tool_call><|im_end|>' }}{% endfor %}",
)

# name -> (template, message-local, one-render suffix)
TEMPLATES = {
    "strict": (_template(), True, True),
    "call-blocks": (_template(call_blocks=True), True, False),
    "inline-tools": (_template(inline_tools=True), True, True),
    "drops-system": (DROPS_SYSTEM, True, True),
    "call-blocks-inline-tools": (_template(call_blocks=True, inline_tools=True), True, False),
    "persona": (_template(persona=True), True, True),
    "persona-call-blocks": (_template(persona=True, call_blocks=True), True, False),
    "smol": (SMOL_TEMPLATE, True, False),  # a default system turn when none is given
    "raises-on-system": (RAISES_ON_SYSTEM, False, False),
    "headerless": (HEADERLESS, True, True),
    "headerless-call-blocks": (HEADERLESS_CALL_BLOCKS, True, False),
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
        {"role": "assistant", "content": ""},  # an empty reply
        {"role": "user", "content": "bye"},
    ]
    return [[{"role": "system", "content": "be brief"}, *body], body]


@pytest.fixture(scope="module", params=list(TEMPLATES))
def case(request, tmp_path_factory) -> tuple[ChatTokenizer, bool, bool]:
    template, local, fast = TEMPLATES[request.param]
    tok = ChatTokenizer(tokenizer_with_template(tmp_path_factory.mktemp(request.param), template))
    return tok, local, fast


def _tool_sets(tok: ChatTokenizer) -> tuple:
    """Without tools, and with them where the template has a place for them."""
    return (None,) if tok.shows.mode == "refused" else (None, TOOLS)


def _renderable(tok: ChatTokenizer) -> list[list[dict]]:
    """The test conversations this template renders (all but the system one's, for one)."""
    convs = _conversations()
    return convs[1:] if tok.hf.chat_template == RAISES_ON_SYSTEM else convs


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
    checked = 0
    for msgs in _conversations():
        for tools in _tool_sets(tok):
            for k, m in enumerate(msgs):
                if m["role"] == "assistant":
                    try:
                        want = _textbook_suffix(tok, msgs, k, tools)
                    except ChatInputError:  # a conversation this template refuses
                        assert "raise_exception" in tok.hf.chat_template
                        continue
                    assert tok.suffix_after_reply(msgs, k, tools) == want, (k, tools)
                    checked += 1
    assert checked >= 3


def test_a_prompt_ends_with_the_assistant_header(case):
    tok, _, _ = case
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.render(msgs, None, True).endswith("<|im_start|>assistant\n")
    assert not tok.render(msgs, None, False).endswith("<|im_start|>assistant\n")


def test_the_fallback_renderer_renders_what_the_compiled_template_does(case, monkeypatch):
    # without transformers' private compiled template, its public apply_chat_template
    tok, _, _ = case

    def renders() -> list[str]:
        return [
            tok.render(msgs, tools, gen)
            for msgs in _renderable(tok)
            for tools in _tool_sets(tok)
            for gen in (False, True)
        ]

    want = renders()
    monkeypatch.setattr(tok, "_template", None)
    assert renders() == want
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
    msgs = _renderable(tok)[0]
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

    tok, local, _ = case
    tools = None if tok.shows.mode == "refused" else TOOLS
    calls = SessionCalls()
    m1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    m1 = m1[1:] if tok.hf.chat_template == RAISES_ON_SYSTEM else m1
    inp1 = build_chat_input(tok, calls, m1, tools)
    assert inp1.mode == "branch"
    out = [*tok.encode("hello there"), tok.im_end_id]
    content, _ = add_call(tok, calls, "r1", 0, inp1, out)
    m2 = [*m1, {"role": "assistant", "content": content}, {"role": "user", "content": "more"}]
    inp2 = build_chat_input(tok, calls, m2, tools)
    ctx = [*inp1.input_ids.tolist(), *out]
    assert inp2.mode == "extend" and inp2.input_ids.tolist()[: len(ctx)] == ctx
    after = _textbook_suffix(tok, m2, len(m1), tools)[len(tok.im_end) :]  # the output holds it
    assert _tokens_text(tok, inp2.input_ids[len(ctx) :]) == after
    prompt, turn = tok.render(m1, tools, True), tok.render(m2[: len(m1) + 1], tools, False)
    if turn.startswith(prompt):  # its prompt's header is its history's: the whole text is
        assert _tokens_text(tok, inp2.input_ids) == tok.render(m2, tools, True)  # the full one
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


# the last message marked: adding a turn changes the text of the one before (not prefix-stable)
MARKS_LAST = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content }}"
    "{% if loop.last %}{{ ' (latest)' }}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_template_that_is_not_prefix_stable_renders_everything(tmp_path):

    tok = ChatTokenizer(tokenizer_with_template(tmp_path, MARKS_LAST))
    m1 = [{"role": "user", "content": "hi"}]
    calls = SessionCalls()
    inp1 = build_chat_input(tok, calls, m1, None)
    out = [*tok.encode("hello"), tok.im_end_id]
    content, _ = add_call(tok, calls, "r1", 0, inp1, out)
    m2 = [*m1, {"role": "assistant", "content": content}, {"role": "user", "content": "more"}]
    assert tok.suffix_after_reply(m2, 1, None) is None  # no text follows the reply as such
    inp2 = build_chat_input(tok, calls, m2, None)
    assert inp2.mode == "branch" and inp2.after == "r1"  # it is still that call's next turn
    assert inp2.input_ids.tolist() == tok.encode(tok.render(m2, None, True))


def test_the_template_sees_the_tokenizers_special_tokens(tmp_path):
    tok = ChatTokenizer(
        tokenizer_with_template(
            tmp_path,
            "{{ '[' + eos_token + ']' }}{% for m in messages %}{{ m.content }}{% endfor %}",
        )
    )
    assert tok.render([{"role": "user", "content": "x"}], None, False) == f"[{tok.im_end}]x"


def test_a_content_part_the_template_cannot_show_is_refused_saying_which(tmp_path):
    tok = ChatTokenizer(tokenizer_with_template(tmp_path, _template()))
    part = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    with pytest.raises(ChatInputError, match=r"^content part 'input_audio' cannot be shown") as e:
        tok.render([{"role": "user", "content": [part]}], None, True)
    assert e.value.param is None


def test_the_extend_paths_on_bodies_of_every_shape(tmp_path, monkeypatch):

    tok = ChatTokenizer(tokenizer_with_template(tmp_path, _template(persona=True)))
    calls = SessionCalls()
    m0 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    u = {"role": "user", "content": "and this"}
    m1 = [*m0, u]  # the call was made on one more message than the last body held
    inp1 = build_chat_input(tok, calls, m1, None)
    out = [*tok.encode("hello there"), tok.im_end_id]
    content, _ = add_call(tok, calls, "r1", 0, inp1, out)
    reply = {"role": "assistant", "content": content}
    key0 = message_chain(m0, None)[-1]

    # a body ending with the reply itself: extended, the same by both paths
    ends = build_chat_input(tok, calls, [*m1, reply], None)
    assert ends.mode == "extend" and ends.after == "r1" and ends.after_at == len(m1)
    got = extend_chat_input(tok, calls, m0[0], len(m0), [u, reply], None, key0)
    assert got is not None and got.input_ids.tolist() == ends.input_ids.tolist()
    assert got.after == "r1" and got.after_at == len(m1)  # t + j: the reply's place
    del ends, got

    # the reply, then an assistant turn of the harness's own (no call of ours): still extended
    other = {"role": "assistant", "content": "an aside"}
    new = [u, reply, {"role": "user", "content": "more"}, other, {"role": "user", "content": "go"}]
    whole = build_chat_input(tok, calls, [*m0, *new], None)
    assert whole.mode == "extend" and whole.after == "r1"
    got = extend_chat_input(tok, calls, m0[0], len(m0), new, None, key0)
    assert got is not None and got.input_ids.tolist() == whole.input_ids.tolist()
    # `whole` holds the spine's buffer: this input is a copy, still int32 ids
    assert got.input_ids.dtype == np.int32 and whole.input_ids.dtype == np.int32
    del whole, got

    # the model's context counts on both paths, before tokenizing
    ctx = len(inp1.input_ids) + len(out)
    with pytest.raises(ContextTooLong):
        build_chat_input(tok, SessionCalls(), [*m0, *new], None, limit=8)  # a branch
    with pytest.raises(ContextTooLong):  # an extension: the call's context + its new text
        build_chat_input(tok, calls, [*m0, *new], None, limit=ctx + 1)

    # the session's chain memo: a next body re-keys its new messages only
    seen = count_message_keys(monkeypatch)
    body = [*m0, *new]
    build_chat_input(tok, calls, body, None)
    seen.clear()
    build_chat_input(tok, calls, [*body, reply, {"role": "user", "content": "end"}], None)
    assert len(seen) <= 2 + 3  # the two new messages' keys (+ the reply lookups' digests)


def test_a_body_sent_again_after_the_model_repeated_its_last_turn_is_not_an_extension(
    tmp_path,
):
    # a call on [u, a] whose reply was a's text again: the same body sent once more holds no
    # reply of that call (that would be [u, a, a]); it is templated whole, by both paths

    tok = ChatTokenizer(tokenizer_with_template(tmp_path, _template()))
    calls = SessionCalls()
    head = {"role": "system", "content": "be brief"}
    body = [head, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "same"}]
    inp1 = build_chat_input(tok, calls, body, None)
    out = [*tok.encode("same"), tok.im_end_id]
    assert add_call(tok, calls, "r1", 0, inp1, out) == ("same", [])
    again = build_chat_input(tok, calls, body, None)
    assert again.mode == "branch" and again.after is None
    assert again.input_ids.tolist() == tok.encode(tok.render(body, None, True))
    key = message_chain(body[:1], None)[-1]
    assert extend_chat_input(tok, calls, head, 1, body[1:], None, key) is None
