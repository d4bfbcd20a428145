"""infra/chat.py: token-exact chat inputs, parent selection, tool-call parsing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from infra.engine.tiny_model import make_tiny_model
from infra.gateway.chat import (
    CHUNK,
    ChatInputError,
    ChatTokenizer,
    SessionCalls,
    apply_stop,
    build_chat_input,
    build_token_input,
    normalize_messages,
    parse_output,
    reply_key,
)
from storage.tito import common_prefix_len


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer(make_tiny_model())


def _finish(tok, calls, rid, seq, inp, text, *, eos=True):
    """Pretend the model generated `text` (canonical tokens) for `inp`; record the call."""
    out = tok.encode(text) + ([tok.im_end_id] if eos else [])
    content, tcs = parse_output(tok.decode(out))
    calls.add(
        rid, seq, inp, np.asarray(out), reply=reply_key(content, tcs), im_end_id=tok.im_end_id
    )
    return out, content, tcs


SYS = {"role": "system", "content": "You are a helpful assistant."}


def test_parse_output_cases():
    assert parse_output("The answer is 42.") == ("The answer is 42.", [])
    content, calls = parse_output(
        'Let me check.\n<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'
    )
    assert content == "Let me check."
    assert calls[0]["function"]["name"] == "search"
    assert json.loads(calls[0]["function"]["arguments"]) == {"q": "x"}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    content, calls = parse_output(
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": "{\\"k\\": 1}"}\n</tool_call>'
    )
    assert content is None and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert calls[1]["function"]["arguments"] == '{"k": 1}'
    bad = 'x <tool_call>\n{"name": "a", "arguments": {\n</tool_call>'
    assert parse_output(bad) == (bad, [])
    unterminated = 'x <tool_call>{"name": "a"}'
    assert parse_output(unterminated) == (unterminated, [])
    no_name = '<tool_call>{"arguments": {}}</tool_call>'
    assert parse_output(no_name) == (no_name, [])


def test_apply_stop():
    assert apply_stop("hello world END more", ["END", "wor"]) == 6
    assert apply_stop("abc", ["x"]) is None


def test_normalize_rejects_bad_messages():
    nulls = [{"role": "user", "content": None}]  # only an assistant's content may be null
    for bad in [[], "x", [{"content": "no role"}], [{"role": "user", "content": 3}], nulls]:
        with pytest.raises(ChatInputError):
            normalize_messages(bad)
    msgs = normalize_messages([{"role": "assistant", "content": None, "refusal": None}])
    assert msgs == [{"role": "assistant", "content": ""}]


def test_extend_reuses_generated_ids_and_templates_suffix(tok):
    calls = SessionCalls()
    m1 = [SYS, {"role": "user", "content": "What is two plus two?"}]
    inp1 = build_chat_input(tok, calls, m1, None)
    assert inp1.parent_request_id is None and inp1.prefix_len == 0
    assert inp1.input_ids.tolist() == tok.encode(tok.render(m1, None, True))
    # a non-canonical tokenisation of the reply: one token per character
    text = "Two plus two equals four."
    out1 = [t for ch in text for t in tok.encode(ch)] + [tok.im_end_id]
    assert out1[:-1] != tok.encode(text)
    content, tcs = parse_output(tok.decode(out1))
    calls.add(
        "r1", 0, inp1, np.asarray(out1), reply=reply_key(content, tcs), im_end_id=tok.im_end_id
    )

    m2 = [*m1, {"role": "assistant", "content": content}, {"role": "user", "content": "Thanks!"}]
    inp2 = build_chat_input(tok, calls, m2, None)
    assert inp2.mode == "extend"
    ctx1 = inp1.input_ids.tolist() + out1
    assert inp2.input_ids.tolist()[: len(ctx1)] == ctx1  # generated ids kept exactly
    suffix = tok.render(m2, None, True)[len(tok.render(m2[:3], None, False)) - 1 :]
    assert suffix.startswith("\n<|im_start|>user")
    assert inp2.input_ids.tolist()[len(ctx1) :] == tok.encode(suffix)
    assert inp2.parent_request_id == "r1" and inp2.prefix_len == len(ctx1)
    assert inp2.new_input_ids.tolist() == tok.encode(suffix)
    # the templated version differs (canonical tokens): the gateway must not use it
    assert inp2.input_ids.tolist() != tok.encode(tok.render(m2, None, True))


def test_extend_after_length_cut_closes_with_template(tok):
    calls = SessionCalls()
    m1 = [{"role": "user", "content": "Tell me a story."}]
    inp1 = build_chat_input(tok, calls, m1, None)
    out1, content, _ = _finish(tok, calls, "r1", 0, inp1, "Once upon a time", eos=False)
    m2 = [*m1, {"role": "assistant", "content": content}, {"role": "user", "content": "Go on."}]
    inp2 = build_chat_input(tok, calls, m2, None)
    ctx1 = inp1.input_ids.tolist() + out1
    assert inp2.mode == "extend" and inp2.input_ids.tolist()[: len(ctx1)] == ctx1
    assert inp2.input_ids.tolist()[len(ctx1)] == tok.im_end_id  # template closes the turn


def test_tool_call_round_trip_extends(tok):
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    calls = SessionCalls()
    m1 = [SYS, {"role": "user", "content": "Weather in Paris?"}]
    inp1 = build_chat_input(tok, calls, m1, tools)
    assert "# Tools" in tok.decode(inp1.input_ids)
    gen = 'Let me check.\n<tool_call>\n{"name": "search", "arguments": {"query": "Paris"}}\n</tool_call>'
    out1, content, tcs = _finish(tok, calls, "r1", 0, inp1, gen)
    assert content == "Let me check." and tcs[0]["function"]["name"] == "search"
    # the openai client sends the assistant message back with extra null fields
    echoed = {
        "role": "assistant",
        "content": content,
        "tool_calls": tcs,
        "refusal": None,
        "function_call": None,
    }
    m2 = [
        *m1,
        echoed,
        {"role": "tool", "tool_call_id": tcs[0]["id"], "content": '{"temperature": 21}'},
    ]
    inp2 = build_chat_input(tok, calls, normalize_messages(m2), tools)
    assert inp2.mode == "extend" and inp2.parent_request_id == "r1"
    assert inp2.prefix_len == len(inp1.input_ids) + len(out1)
    # different tools: the system turn changes, no extension
    inp3 = build_chat_input(tok, calls, normalize_messages(m2), None)
    assert inp3.mode == "branch"


def test_rollback_is_a_branch_with_longest_prefix(tok):
    calls = SessionCalls()
    msgs = [SYS, {"role": "user", "content": "Step one."}]
    inp = build_chat_input(tok, calls, msgs, None)
    history = []
    for turn in range(3):
        _, content, _ = _finish(tok, calls, f"r{turn}", turn, inp, f"Done with step {turn}.")
        history.append(list(msgs))
        msgs = [
            *msgs,
            {"role": "assistant", "content": content},
            {"role": "user", "content": "Next."},
        ]
        inp = build_chat_input(tok, calls, msgs, None)
        assert inp.mode == "extend" and inp.parent_request_id == f"r{turn}"
    # rollback: the harness drops the last exchange and asks something else
    rb = [*history[1], {"role": "assistant", "content": "Done with step 1."}]
    rb = [*rb, {"role": "user", "content": "Something else."}]
    inp_rb = build_chat_input(tok, calls, rb, None)
    assert inp_rb.mode == "extend"
    ctx_r1 = calls.context("r1").tolist()
    assert inp_rb.input_ids.tolist()[: len(ctx_r1)] == ctx_r1
    # longest shared prefix: r2's input also starts with r1's context + "\n<|im_start|>user\n"
    assert inp_rb.parent_request_id == "r2" and inp_rb.prefix_len > len(ctx_r1)
    # summarised context: no earlier call matches, templated whole, shares the system prompt
    summ = [SYS, {"role": "user", "content": "Summary: steps done."}]
    inp_s = build_chat_input(tok, calls, summ, None)
    assert inp_s.mode == "branch"
    assert inp_s.parent_request_id is not None
    assert 0 < inp_s.prefix_len < len(inp_s.input_ids)
    ids = inp_s.input_ids.tolist()
    best = max(common_prefix_len(ids, calls.context(r)) for r in calls.calls)
    assert inp_s.prefix_len == best


def test_find_parent_matches_brute_force_on_long_random_tree():
    rng = np.random.default_rng(1)
    calls = SessionCalls(ctx_cache=2)
    contexts: dict[str, np.ndarray] = {}
    for i in range(40):
        if contexts and rng.random() < 0.8:
            base = contexts[rng.choice(list(contexts))]
            cut = int(rng.integers(0, len(base) + 1))
            ids = np.concatenate([base[:cut], rng.integers(0, 50, rng.integers(1, 700))])
        else:
            ids = rng.integers(0, 50, rng.integers(1, 900))
        ids = ids.astype(np.int32)
        inp = build_token_input(calls, ids)
        brute_k = max([common_prefix_len(ids, c) for c in contexts.values()], default=0)
        assert inp.prefix_len == brute_k, i
        if inp.parent_request_id is not None:
            ctx = contexts[inp.parent_request_id]
            assert common_prefix_len(ids, ctx) == inp.prefix_len
        out = rng.integers(0, 50, rng.integers(1, 300)).astype(np.int32)
        calls.add(f"r{i}", i, inp, out)
        contexts[f"r{i}"] = np.concatenate([ids, out])
    for rid, ctx in contexts.items():  # rebuilt from deltas (cache holds only 2)
        assert np.array_equal(calls.context(rid), ctx)
    assert max(len(c) for c in contexts.values()) > 3 * CHUNK


def test_template_is_message_local_and_probe_matches_full_render(tok):
    assert tok.message_local
    long = [SYS] + [
        m
        for i in range(30)
        for m in (
            {"role": "user", "content": f"Question {i}?"},
            {"role": "assistant", "content": f"Answer {i}."},
        )
    ]
    msgs = [*long, {"role": "user", "content": "Last."}]
    k = len(long) - 1
    assert tok._suffix(msgs, k, None, probe=True) == tok._suffix(msgs, k, None, probe=False)


def test_one_render_suffix_equals_the_full_render(tok):
    """The fast path (one render, the system turn's rendering cached) gives the text the full
    conversation's rendering has after each assistant reply; a reply holding the end marker's
    text itself goes the two-render way and is still right."""
    assert tok.fast_suffix
    tc = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    convs = [
        [SYS, {"role": "user", "content": "U1"}, {"role": "assistant", "content": "A1"},
         {"role": "user", "content": "U2"}, {"role": "assistant", "content": "", "tool_calls": tc},
         {"role": "tool", "tool_call_id": "c1", "content": "R"}],
        [{"role": "user", "content": "U1"},
         {"role": "assistant", "content": "A1 <|im_end|> spoof"},
         {"role": "user", "content": "U2"}],
    ]  # fmt: skip
    for msgs in convs:
        for tl in (None, tools):
            for k, m in enumerate(msgs):
                if m["role"] != "assistant":
                    continue
                full = tok._suffix(msgs, k, tl, probe=False)[0]
                assert tok.suffix_after_reply(msgs, k, tl) == full
                if "<|im_end|>" not in m["content"]:
                    assert tok._suffix_one_render(msgs, k, tl) == full
