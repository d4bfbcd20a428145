"""Supervised warm start on hand-made conversations: the tokens are the gateway's, only the
assistant's tokens carry loss, the loss falls and the assistant tokens become likelier."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from infra.engine.tiny_model import ARCHS
from infra.gateway.chat import ChatTokenizer, normalize_messages
from tasks.train.sft import SftError, tokenize_conversation, warm_start

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
CONVERSATIONS = [
    [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "8"},
    ],
    [
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello! How are you?"},
    ],
    {
        "messages": [
            {"role": "user", "content": "Compute 12 * 7."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "calculator", "arguments": '{"expression": "12*7"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "84.0"},
            {"role": "assistant", "content": "The answer is 84."},
        ],
        "tools": TOOLS,
    },
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls: one thread is faster and steadier on a shared 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_dir(request, tmp_path_factory):
    """The tiny model (Qwen3 unless parametrized with another architecture family)."""
    from infra.engine.tiny_model import make_tiny_model

    arch = getattr(request, "param", "qwen3")
    return make_tiny_model(tmp_path_factory.mktemp("sft") / arch, seed=0, arch=arch)


def split(conv):
    return (conv["messages"], conv["tools"]) if isinstance(conv, dict) else (conv, None)


def gateway_turns(ct: ChatTokenizer, conv):
    """Per assistant turn: (the gateway's input ids for the call, the reply's ids), from the
    gateway's own template path: the whole conversation so far templated and encoded."""
    msgs, tools = split(conv)
    msgs = normalize_messages(msgs)
    out = []
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = ct.render(msgs[:k], tools, True)
        reply = ct.render(msgs[: k + 1], tools, False)[len(prompt) :]
        reply = reply[: reply.index(ct.im_end) + len(ct.im_end)]
        out.append((ct.encode(prompt), ct.encode(reply)))
    return out


def test_tokens_are_the_gateways_and_only_the_assistant_is_a_target(tiny_dir):
    from transformers import AutoTokenizer

    ct, hf = ChatTokenizer(str(tiny_dir)), AutoTokenizer.from_pretrained(str(tiny_dir))
    for conv in CONVERSATIONS:
        ids, target = tokenize_conversation(hf, conv)
        turns = gateway_turns(ct, conv)
        starts = [i for i in range(len(ids)) if target[i] and (i == 0 or not target[i - 1])]
        assert len(starts) == len(turns)
        for s, (prompt, reply) in zip(starts, turns, strict=True):
            assert ids[:s].tolist() == prompt  # what the model saw for that call
            assert ids[s : s + len(reply)].tolist() == reply and target[s : s + len(reply)].all()
        assert int(target.sum()) == sum(len(r) for _, r in turns)
        said = ct.decode(ids[target])
        msgs, _ = split(conv)
        for m in msgs:
            if m["role"] == "assistant" and m["content"]:
                assert m["content"] in said
            elif m["role"] in ("user", "system", "tool"):
                assert m["content"] not in said
        assert ids[target].tolist().count(ct.im_end_id) == len(turns)  # each turn's end


def test_refuses_what_it_cannot_learn_from(tiny_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_dir))
    with pytest.raises(SftError, match="no assistant"):
        tokenize_conversation(hf, [{"role": "user", "content": "hi"}])
    with pytest.raises(SftError, match="role"):
        tokenize_conversation(hf, [{"content": "hi"}])
    with pytest.raises(SftError) as info:
        warm_start(str(tiny_dir), [], "/nonexistent", steps=0, lr=0)
    assert all(x in str(info.value) for x in ("steps=0", "lr=0", "no conversations"))


def test_tools_on_a_template_without_a_tool_section_are_refused_not_dropped(tmp_path):
    """SmolLM2's template drops ``tools``; the gateway writes them into the system turn, so
    a warm start on the template's rendering would train on tokens the model never sees."""
    from transformers import AutoTokenizer

    from tests.infra.gateway.fixtures import SMOL_TEMPLATE, tokenizer_with_template

    hf = AutoTokenizer.from_pretrained(tokenizer_with_template(tmp_path, SMOL_TEMPLATE))
    conv = {"messages": CONVERSATIONS[0], "tools": TOOLS}
    with pytest.raises(SftError, match="does not show tools"):
        tokenize_conversation(hf, conv)
    tokenize_conversation(hf, CONVERSATIONS[0])  # without tools: fine


def mean_assistant_logprob(model_dir, conversations):
    """Textbook: log-softmax of a plain forward, averaged over the assistant tokens (the mask
    checked above) -- not the function under test."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for conv in conversations:
            ids, target = tokenize_conversation(hf, conv)
            lps = torch.log_softmax(model(input_ids=torch.as_tensor(ids)[None]).logits[0], -1)
            for i in np.flatnonzero(target):
                total += float(lps[i - 1, ids[i]])
                n += 1
    return total / n, n


@pytest.mark.parametrize("tiny_dir", ARCHS, indirect=True)
def test_warm_start_lowers_the_loss_and_raises_the_assistant_tokens(tiny_dir, tmp_path):
    before, n = mean_assistant_logprob(tiny_dir, CONVERSATIONS)
    res = warm_start(
        str(tiny_dir), CONVERSATIONS, str(tmp_path / "warm"), steps=25, lr=3e-3, batch_size=3
    )
    # step 0 sees every conversation at the initial weights: the textbook mean NLL over the
    # assistant tokens and nothing else (a mask with other tokens would give another number)
    assert res.losses[0] == pytest.approx(-before, rel=1e-5)
    assert res.n_target_tokens == n
    assert res.losses[-1] < 0.5 * res.losses[0], res.losses
    after, _ = mean_assistant_logprob(res.out_dir, CONVERSATIONS)
    assert after > before + 1.0, (before, after)
    out = Path(res.out_dir)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    meta = json.loads((out / "warm_start.json").read_text())
    assert meta["steps"] == 25 and meta["conversations"] == 3
    assert all(math.isfinite(x) for x in meta["losses"])
    # the checkpoint serves: the gateway's tokenizer loads from it
    assert ChatTokenizer(res.out_dir).encode("hi")
