"""Supervised warm start: next-token training on the assistant turns of chat conversations.

``warm_start(model_dir, conversations, out_dir, steps=...)`` loads a causal LM, trains it
for ``steps`` AdamW steps on the tokens the assistant said (everything else is context and
carries no loss) and writes a new checkpoint directory (weights + the tokenizer files), which
a run can start from (``model.path``).

Tokens are exactly what the gateway (infra/gateway/chat.py) would put in front of the model
and record for the same conversation: the model's own chat template renders the messages, the
text is encoded without added special tokens, and each assistant turn is cut where a call's
output would be: the prompt is the rendering of the messages before it with the generation
prompt, the target is what the full rendering adds after that prompt up to and including the
end-of-turn marker (``<|im_end|>``: the model generates it; the newline after it is the next
call's input). Tools on a template without a tool section (SmolLM2's) are refused with
``SftError``: the gateway rewrites them into the system turn, which this module cannot
reproduce from below the gateway. Like the gateway's "extend" path, the ids are the segments encoded one by one
(prompt, target, text up to the next generation prompt, target, ...). A template that is not
prefix-stable at a turn (the rendering of the earlier messages is not a prefix of the longer
one) is refused with ``SftError``.

A conversation is a list of ``{"role", "content"}`` messages (``tool_calls`` allowed), or a
mapping ``{"messages": [...], "tools": [...]}``; ``None`` fields are dropped and a ``None``
content renders as "" (as the gateway normalises them).

Pure module: no prefect, no distributed (reads and writes the two checkpoint directories).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from tasks.train.trainer import TOKENIZER_FILES

log = logging.getLogger(__name__)

META_FILE = "warm_start.json"


class SftError(ValueError):
    """A conversation cannot be turned into supervised targets, or bad settings."""


@dataclass(frozen=True)
class WarmStart:
    """What ``warm_start`` did: the new checkpoint and the loss of every step."""

    out_dir: str
    losses: list[float]  # mean next-token loss over the step's assistant tokens
    n_target_tokens: int  # assistant tokens over all conversations


def _messages(conv: Any) -> tuple[list[dict], list | None]:
    if isinstance(conv, Mapping):
        msgs, tools = conv.get("messages"), conv.get("tools")
    else:
        msgs, tools = conv, None
    if not isinstance(msgs, Sequence) or isinstance(msgs, str) or not msgs:
        raise SftError("a conversation must be a non-empty list of {role, content} messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise SftError(f"messages[{i}] must be a mapping with a string 'role'")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["content"] = m.get("content") if m.get("content") is not None else ""
        out.append(msg)
    return out, (list(tools) if tools else None)


def tokenize_conversation(tokenizer: Any, conversation: Any) -> tuple[np.ndarray, np.ndarray]:
    """(ids (L,) int64, target (L,) bool): the conversation's tokens as the gateway would
    give them to the model, and which of them the assistant generated."""
    messages, tools = _messages(conversation)
    end = tokenizer.eos_token or "<|im_end|>"
    backend = getattr(tokenizer, "backend_tokenizer", None) or tokenizer._tokenizer

    def render(msgs: list[dict], gen: bool) -> str:
        return tokenizer.apply_chat_template(
            msgs, tools=tools, tokenize=False, add_generation_prompt=gen
        )

    def encode(text: str) -> list[int]:
        return backend.encode(text, add_special_tokens=False).ids

    if tools and render(messages[:1], False) == tokenizer.apply_chat_template(
        messages[:1], tokenize=False, add_generation_prompt=False
    ):
        raise SftError(
            "the chat template does not show tools (it renders the same with and without "
            "them): the gateway writes them into the system turn instead "
            "(infra/gateway/tool_prompt.py), which a warm start on this template would not "
            "train on; warm-start a model whose template has a tool section, or a suite "
            "without tools"
        )
    ids: list[int] = []
    target: list[bool] = []
    done = ""  # the text already turned into ids
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render(messages[:k], True)
        full = render(messages[: k + 1], False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise SftError(
                f"the chat template is not prefix-stable at message {k}: the rendering of "
                "the earlier messages is not a prefix of the longer one, so the turn's tokens "
                "cannot be cut the way the gateway records them"
            )
        reply = full[len(prompt) :]
        cut = reply.find(end)
        reply = reply[: cut + len(end)] if cut >= 0 else reply
        context = encode(prompt[len(done) :])
        said = encode(reply)
        ids += context + said
        target += [False] * len(context) + [True] * len(said)
        done = prompt + reply
    if not any(target):
        raise SftError("the conversation has no assistant message: nothing to learn from")
    return np.asarray(ids, np.int64), np.asarray(target, bool)


def assistant_nll(
    model: torch.nn.Module, ids: np.ndarray, target: np.ndarray, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Summed negative log-likelihood of the target tokens (a scalar tensor)."""
    x = torch.as_tensor(ids, device=device)[None]  # (1, L)
    logits = model(input_ids=x).logits[0, :-1]  # (L-1, V): predicts tokens 1..L-1
    lp = torch.log_softmax(logits.float(), -1).gather(-1, x[0, 1:, None])[:, 0]
    return -lp[torch.as_tensor(target[1:], device=device)].sum()


def warm_start(
    model_dir: str,
    conversations: Sequence[Any],
    out_dir: str,
    *,
    steps: int = 50,
    lr: float = 1e-3,
    batch_size: int = 8,
    seed: int = 0,
    weight_decay: float = 0.0,
    max_grad_norm: float | None = 1.0,
    device: str = "cpu",
    progress: Any = None,
) -> WarmStart:
    """Train ``model_dir`` for ``steps`` steps on the assistant tokens of ``conversations``
    and save the result to ``out_dir`` (see the module docstring).

    Each step takes the next ``batch_size`` conversations of a seeded shuffle (reshuffled
    every pass) and minimises the mean next-token loss over their assistant tokens (a token
    mean over the batch). Returns the per-step losses. ``progress``: a text stream for a
    progress bar with the loss (tqdm; a warm start runs minutes), None for none.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    errors = []
    if steps < 1:
        errors.append(f"steps={steps}: must be >= 1")
    if not lr > 0:
        errors.append(f"lr={lr}: must be > 0")
    if batch_size < 1:
        errors.append(f"batch_size={batch_size}: must be >= 1")
    if not conversations:
        errors.append("no conversations: give at least one demonstration")
    if errors:
        raise SftError("; ".join(errors))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = [tokenize_conversation(tokenizer, c) for c in conversations]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    rng = np.random.default_rng(seed)
    order: list[int] = []
    losses = []
    bar = tqdm(total=steps, desc="warm start", unit="step", file=progress, mininterval=1.0,
               disable=progress is None)  # fmt: skip
    for step in range(steps):
        batch = []
        while len(batch) < min(batch_size, len(data)):
            if not order:
                order = rng.permutation(len(data)).tolist()
            batch.append(order.pop())
        n = sum(int(data[i][1][1:].sum()) for i in batch)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in batch:
            loss = assistant_nll(model, *data[i], device) / n
            loss.backward()
            total += float(loss.detach())
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        losses.append(total)
        log.debug("warm start step %d: loss %.4f", step, total)
        bar.update(1)
        bar.set_postfix_str(f"loss {total:.4f}", refresh=False)
    bar.close()
    if not all(math.isfinite(x) for x in losses):
        raise SftError(f"the loss is not finite ({losses[-1]}): lower lr={lr}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    src = Path(model_dir)
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and src.resolve() != out.resolve():
            shutil.copy2(src / name, out / name)
    n_target = int(sum(t[1:].sum() for _, t in data))
    (out / META_FILE).write_text(
        json.dumps(
            {
                "base": str(model_dir),
                "steps": steps,
                "lr": lr,
                "batch_size": batch_size,
                "seed": seed,
                "conversations": len(data),
                "target_tokens": n_target,
                "losses": losses,
            }
        )
    )
    return WarmStart(str(out), losses, n_target)
