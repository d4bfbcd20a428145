"""infra/gateway/chat.py where generated mutants survived its other fast tests
(bench/mutation.py): the tiny model's template passes the message-local self-check (and
takes the one-render fast path), token inputs are labelled ``tokens``, a flat tool call
keys like an OpenAI one, and null fields of content parts are dropped (not the others)."""

from __future__ import annotations

import numpy as np
import pytest

from infra.engine.tiny_model import make_tiny_model
from infra.gateway.chat import (
    BIG_TEXT,
    ChainMemo,
    ChatInputError,
    ChatTokenizer,
    ContextTooLong,
    SessionCalls,
    apply_stop,
    build_chat_input,
    build_token_input,
    message_chain,
    message_key,
    normalize_messages,
    parse_output,
    reply_key,
    same_json,
)
from infra.gateway.token_bound import min_tokens
from tests.infra.gateway.fixtures import count_message_keys


def _tiny_hf():
    """A fresh copy of the tiny model's HF tokenizer, to edit and save elsewhere."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tiny_model())


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer(make_tiny_model())


def test_a_message_local_template_takes_the_fast_suffix(tok):
    # the tiny model's template (Qwen's) renders each message on its own: the self-check
    # must say so, and the one-render suffix must be on (else every turn renders twice)
    assert tok.message_local is True
    assert tok.fast_suffix is True


def test_token_inputs_are_marked_as_tokens():
    inp = build_token_input(SessionCalls(), [3, 4, 5])
    assert inp.mode == "tokens" and inp.parent_request_id is None and inp.prefix_len == 0
    assert inp.input_ids.tolist() == [3, 4, 5]


def test_a_flat_tool_call_keys_like_an_openai_one():
    flat = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"name": "f", "arguments": '{"a": 1}'}],
    }
    nested = [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]
    assert message_key(flat) == reply_key("", nested)
    assert message_key(flat) != reply_key("", [{"function": {"name": "g", "arguments": {}}}])


def test_content_parts_lose_only_their_null_fields():
    got = normalize_messages(
        [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": None}]}]
    )
    assert got == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


def test_encode_adds_no_special_tokens_even_where_the_tokenizer_would(tok, tmp_path):
    # the tiny tokenizer adds none by itself: give a copy a post-processor that prepends one
    # (as Llama's does), and the text must still be its tokens alone (the template has them),
    # on the plain path and on the long texts' batch path
    from tokenizers import processors

    bos = tok.im_end  # any special token the vocabulary has
    hf = _tiny_hf()
    hf.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.im_end_id)]
    )
    hf.save_pretrained(tmp_path)
    with_bos = ChatTokenizer(str(tmp_path))
    assert with_bos.backend.encode("hello world").ids[0] == tok.im_end_id  # it would add one
    assert with_bos.encode("hello world") == tok.encode("hello world")
    assert tok.im_end_id not in with_bos.encode("hello world")
    big = "hello world " * (BIG_TEXT // 12 + 1)  # the GIL-releasing batch path
    assert len(big) >= BIG_TEXT
    assert with_bos.backend.encode(big).ids[0] == tok.im_end_id
    assert with_bos.encode(big) == tok.encode(big)
    assert with_bos.encode(big)[0] != tok.im_end_id


@pytest.mark.parametrize(
    ("tool_calls", "says"),
    [
        ({"name": "f"}, "tool_calls must be a list"),
        (["f"], "each tool call must be an object"),
        ([{"function": "f"}], "a tool call needs function.name"),
        ([{"function": {"arguments": "{}"}}], "a tool call needs function.name"),
        ([{"function": {"name": 3, "arguments": "{}"}}], "a tool call needs function.name"),
        ([{"name": None}], "a tool call needs function.name"),
    ],
)
def test_a_malformed_tool_call_is_refused_by_its_key(tool_calls, says):
    # the key of a reply, or of a message of the history, is never made of a tool call
    # the template could not render (a name that is not a string, no function object)
    with pytest.raises(ChatInputError, match=f"^{says}$"):
        reply_key("", tool_calls)
    with pytest.raises(ChatInputError, match=f"^{says}$"):
        message_key({"role": "assistant", "content": "", "tool_calls": tool_calls})


def test_context_too_long_says_what_it_knows():
    err = ContextTooLong(limit=100, known=30, at_least=80, chars=400)
    assert err.limit == 100 and err.at_least == 110
    assert str(err) == (
        "This model's maximum context length is 100 tokens; the input has at least 110 "
        "(30 tokens before a text of 400 characters, at least 80 tokens by its length; not "
        "tokenized): shorten it"
    )
    assert err.code == "context_length_exceeded"
    alone = ContextTooLong(limit=100, known=0, at_least=120, chars=500)
    assert alone.at_least == 120
    assert "has at least 120 (a text of 500 characters, at least 120 tokens" in str(alone)


def test_a_special_tokens_text_is_its_marker(tok):
    # the text of each output token (logprobs, stop strings) keeps the end marker
    assert tok.token_str(tok.im_end_id) == "<|im_end|>"
    assert tok.token_str(tok.im_end_id) == "<|im_end|>"  # and again, from the cache
    assert tok.decode([*tok.encode("hi"), tok.im_end_id]) == "hi"  # decode drops it


def test_the_end_marker_is_the_tokenizers_eos_token(tmp_path):
    hf = _tiny_hf()
    hf.eos_token = "<|endoftext|>"
    hf.save_pretrained(tmp_path)
    other = ChatTokenizer(str(tmp_path))
    assert other.im_end == "<|endoftext|>"
    assert other.im_end_id == hf.convert_tokens_to_ids("<|endoftext|>")


def test_a_tokenizer_without_a_chat_template_is_refused_by_name(tmp_path):
    hf = _tiny_hf()
    hf.chat_template = None
    hf.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ChatInputError, match=f"^tokenizer in {tmp_path} has no chat template$"):
        ChatTokenizer(str(tmp_path))


def test_a_text_that_just_reaches_the_context_is_refused(tok):
    text = "hello " * 200
    n = min_tokens(text, tok.token_cap)
    assert n > 0
    with pytest.raises(ContextTooLong) as err:  # known + the least it can take == limit
        tok.encode(text, limit=1000, known=1000 - n)
    assert err.value.limit == 1000 and err.value.at_least == 1000
    assert "maximum context length is 1000 tokens" in str(err.value)
    assert f"a text of {len(text)} characters" in str(err.value)
    assert tok.encode(text, limit=1001, known=1000 - n) == tok.encode(text)


def test_same_json_tells_types_apart_at_every_node():
    assert same_json({"a": [1, {"b": True}]}, {"a": [1, {"b": True}]})
    assert same_json("x", "x") and same_json([], [])
    assert not same_json({"a": [1]}, {"a": [1.0]})  # 1 == 1.0, rendered differently
    assert not same_json({"a": [1]}, {"a": [True]})
    assert not same_json([{"b": 1}], [{"b": 1.0}])
    assert not same_json(1, 1.0) and not same_json(1, True)
    assert not same_json({"a": 1}, {"a": 2}) and not same_json([1], [1, 2])


def test_the_chain_memo_rehashes_only_what_changed(monkeypatch):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"n": 1}}}]
    msgs = [{"role": "user", "content": f"m{i}"} for i in range(6)]
    fresh = message_chain(msgs, tools)
    memo = ChainMemo()
    assert message_chain(msgs[:4], tools, memo) == fresh[:5]
    seen = count_message_keys(monkeypatch)
    assert message_chain(msgs, tools, memo) == fresh
    assert len(seen) == 2  # the two new messages only
    seen.clear()
    edited = [*msgs[:2], {"role": "user", "content": "other"}, *msgs[3:]]
    assert message_chain(edited, tools, memo) == message_chain(edited, tools)
    assert len(seen) == 4 + 6  # from the edit on; then the fresh chain, all 6
    seen.clear()
    retyped = [{"type": "function", "function": {"name": "f", "parameters": {"n": 1.0}}}]
    got = message_chain(edited, retyped, memo)  # the tools' 1 became 1.0: nothing reused
    assert len(seen) == 6 and got[0] != fresh[0]
    seen.clear()
    assert message_chain(edited, retyped, memo) == got and not seen  # all reused


def test_the_key_of_a_message_holds_its_name_and_reasoning():
    base = {"role": "assistant", "content": "x"}
    keys = {
        message_key(base),
        message_key({**base, "name": "a"}),
        message_key({**base, "name": "b"}),
        message_key({**base, "reasoning_content": "because"}),
    }
    assert len(keys) == 4
    assert message_key({**base, "name": ""}) == message_key(base)


def test_a_tool_call_without_arguments_keys_as_empty_arguments():
    bare = [{"type": "function", "function": {"name": "f"}}]
    assert reply_key("", bare) == reply_key("", [{"function": {"name": "f", "arguments": "{}"}}])


def test_the_earliest_stop_wins_also_at_the_start():
    assert apply_stop("stop here, stop there", ["stop"]) == 0
    assert apply_stop("ab STOP cd STOP", ["STOP"]) == 3
    assert apply_stop("ab STOP cd END", ["END", "STOP"]) == 3
    assert apply_stop("abc", ["", "z"]) is None


def test_parse_output_keeps_all_the_text_and_fills_arguments():
    text = 'lead <tool_call>{"name": "f"}</tool_call> mid <tool_call>[{"name": "g", "arguments": {"x": 1}}]</tool_call> tail'
    content, calls = parse_output(text)
    assert content == "lead\nmid\ntail"
    assert [c["function"] for c in calls] == [
        {"name": "f", "arguments": "{}"},
        {"name": "g", "arguments": '{"x": 1}'},
    ]
    assert all(c["id"].startswith("call_") and len(c["id"]) == 5 + 24 for c in calls)
    # a block left open with closed ones before it: the whole text is content
    half = '<tool_call>{"name": "f"}</tool_call> <tool_call>{"name": "g"'
    assert parse_output(half) == (half, [])


def test_messages_refused_say_where():
    with pytest.raises(ChatInputError, match=r"^messages must be a non-empty list$"):
        normalize_messages([])
    with pytest.raises(ChatInputError, match=r"^'messages\[0\]\.role': Field required$"):
        normalize_messages([{"content": "x"}])


def test_a_developer_turn_is_a_system_turn_and_calls_lose_their_nulls():
    got = normalize_messages(
        [
            {"role": "developer", "content": "rules"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        ]
    )  # fmt: skip
    assert got[0] == {"role": "system", "content": "rules"}
    assert got[1]["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    ]


def test_inputs_are_int32_ids(tok):
    assert build_token_input(SessionCalls(), [3, 4]).input_ids.dtype == np.int32
    inp = build_chat_input(tok, SessionCalls(), [{"role": "user", "content": "hi"}], None)
    assert inp.input_ids.dtype == np.int32 and inp.mode == "branch"


def test_the_length_bound_counts_added_tokens(tmp_path):
    # an added token longer than any other is one token for its whole text: a bound from the
    # base vocabulary alone would refuse a text of them as too long for a context it fits
    long = "<|" + "x" * 60 + "|>"
    hf = _tiny_hf()
    hf.add_special_tokens({"additional_special_tokens": [long]})
    hf.save_pretrained(tmp_path)
    tok = ChatTokenizer(str(tmp_path))
    text = long * 100
    assert len(tok.encode(text)) == 100
    assert tok.token_cap is None or tok.token_cap >= len(long)
    assert tok.encode(text, limit=101) == tok.encode(text)  # it fits: not refused


def test_a_length_bound_the_tokenizer_breaks_is_dropped(tok):
    # the bound is kept only if the tokenizer keeps it on the probe: one that claims every
    # token is at most one character long is broken by any word, and gives no bound
    assert tok._check_cap(tok.token_cap) == tok.token_cap
    assert tok._check_cap(1) is None
    assert tok._check_cap(None) is None


def test_without_an_eos_token_the_end_marker_is_chatmls(tmp_path):
    hf = _tiny_hf()
    hf.eos_token = None
    hf.save_pretrained(tmp_path)
    bare = ChatTokenizer(str(tmp_path))
    assert bare.hf.eos_token is None
    assert bare.im_end == "<|im_end|>" and bare.im_end_id == hf.convert_tokens_to_ids("<|im_end|>")


def test_a_length_bound_the_probe_just_meets_is_kept(tok, monkeypatch):
    # a tokenizer giving exactly the fewest tokens the bound allows keeps it; one fewer breaks it
    for short, want in ((0, 7), (1, None)):
        monkeypatch.setattr(tok, "encode", lambda text, s=short: [0] * (min_tokens(text, 7) - s))
        assert tok._check_cap(7) == want, short


def test_a_head_that_renders_otherwise_before_a_reply_gives_no_one_render_suffix(tmp_path):
    # the system turn gains a "!" once anything follows it: the cached head is not a prefix of
    # the whole render, so the one-render suffix is refused even though a marker follows it
    hf = _tiny_hf()
    hf.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{% if m['role'] == 'system' and messages|length > 1 %}!{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    hf.save_pretrained(tmp_path)
    bent = ChatTokenizer(str(tmp_path))
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "U2"},
    ]
    assert bent._suffix_one_render(msgs, 2, None) is None
    plain = msgs[1:]  # no system turn: an empty head, a prefix of anything
    assert bent._suffix_one_render(plain, 1, None) == (
        "<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n"
    )
