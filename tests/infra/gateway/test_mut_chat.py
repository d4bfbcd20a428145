"""infra/gateway/chat.py where generated mutants survived its other fast tests
(bench/mutation.py): the tiny model's template passes the message-local self-check (and
takes the one-render fast path), token inputs are labelled ``tokens``, a flat tool call
keys like an OpenAI one, and null fields of content parts are dropped (not the others)."""

from __future__ import annotations

import pytest

from infra.engine.tiny_model import make_tiny_model
from infra.gateway.chat import (
    ChatInputError,
    ChatTokenizer,
    ContextTooLong,
    SessionCalls,
    build_token_input,
    message_key,
    normalize_messages,
    reply_key,
)


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


def test_encode_adds_no_special_tokens_even_where_the_tokenizer_would(tok):
    # the tiny tokenizer adds none by itself: give a copy a post-processor that prepends one
    # (as Llama's does), and the text must still be its tokens alone (the template has them)
    import copy

    from tokenizers import Tokenizer, processors

    bos = tok.im_end  # any special token the vocabulary has
    with_bos = copy.copy(tok)
    with_bos.backend = Tokenizer.from_str(tok.backend.to_str())
    with_bos.backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.im_end_id)]
    )
    assert with_bos.backend.encode("hello world").ids[0] == tok.im_end_id  # it would add one
    assert with_bos.encode("hello world") == tok.encode("hello world")
    assert tok.im_end_id not in with_bos.encode("hello world")


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
    with pytest.raises(ChatInputError, match=says):
        reply_key("", tool_calls)
    with pytest.raises(ChatInputError, match=says):
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
