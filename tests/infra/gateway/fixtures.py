"""Shared fixtures of the gateway integration tests: real engines behind real HTTP servers.

`ScriptedEngine` is the real embedded engine (model, KV cache, batching, HTTP server) with two
test hooks: it records the exact input ids of every request it receives (what token exactness
is checked against), and it can be told what the *next* request's reply tokens are, so that a
random-weight tiny model still "decides" to call a tool. A scripted token is teacher-forced: the
reported logprob is still the model's own ``log_softmax`` of that token.

`tokenizer_with_template` gives the tiny tokenizer another chat template, e.g. `SMOL_TEMPLATE`
(SmolLM2-135M-Instruct's: ChatML, a default system prompt, no tool section). `add_call`
records a finished call in a session as the gateway does (its reply keyed as parsed).
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from infra.engine.engine import Engine
from infra.engine.server import EngineServer
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.chat import ChatTokenizer, SessionCalls, parse_output, reply_key
from storage.tito import reconstruct_inputs
from storage.tito_log import table_to_records


class ScriptedEngine(Engine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.received: dict[str, list[int]] = {}
        self.requests: dict = {}
        self.replies: collections.deque[list[int]] = collections.deque()
        self.scripts: dict[str, list[int]] = {}
        self._hook_lock = threading.Lock()

    def submit(
        self, input_ids, sampling_params=None, *, rid=None, return_logprob=True, listener=None
    ):
        with self._hook_lock:
            if rid is not None and self.replies:
                self.scripts[rid] = self.replies.popleft()
        req = super().submit(
            input_ids, sampling_params, rid=rid, return_logprob=return_logprob, listener=listener
        )
        with self._hook_lock:
            self.received[req.rid] = list(req.input_ids)
            self.requests[req.rid] = req
        return req

    def _choose(self, logits, reqs):
        """The engine's own draw, but a scripted request's token is forced (teacher-forced:
        its logprob is still the model's ``log_softmax`` of that token)."""
        picks = super()._choose(logits, reqs)
        for b, req in enumerate(reqs):
            script = self.scripts.get(req.rid)
            if script is None:
                continue
            i = len(req.output_ids)
            tok = script[i] if i < len(script) else self.eos_token_ids[0]
            picks[b] = (tok, float(torch.log_softmax(logits[b].float(), dim=-1)[tok]))
        return picks


@contextmanager
def serving(engines: dict[str, Engine]) -> Iterator[dict[str, str]]:
    """Each engine behind its own HTTP server; yields their base URLs by cell id and stops
    the servers and closes the engines afterwards."""
    servers = {c: EngineServer(e) for c, e in engines.items()}
    try:
        yield {c: s.start() for c, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
        for e in engines.values():
            e.close()


# SmolLM2-135M-Instruct's chat template, verbatim.
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tokenizer_with_template(out: Path, template: str) -> str:
    """The tiny tokenizer with another chat template (tokenizer files only)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(make_tiny_model())
    hf.chat_template = template
    hf.save_pretrained(out)
    return str(out)


def add_call(
    tok: ChatTokenizer, calls: SessionCalls, rid: str, seq: int, inp, out: list[int]
) -> tuple[str | None, list[dict]]:
    """Record call ``rid`` (input ``inp``, output ids ``out``) in ``calls`` with its reply
    keyed as the gateway parses it; returns that reply's (content, tool_calls)."""
    content, tcs = parse_output(tok.decode(out))
    calls.add(
        rid, seq, inp, np.asarray(out), reply=reply_key(content, tcs), im_end_id=tok.im_end_id
    )
    return content, tcs


def count_message_keys(monkeypatch) -> list[int]:
    """A list that grows by one at each message key `infra.gateway.chat` computes (what its
    chain memo is there to save)."""
    from infra.gateway import chat

    seen: list[int] = []
    real = chat.message_key

    def counted(msg):
        seen.append(1)
        return real(msg)

    monkeypatch.setattr(chat, "message_key", counted)
    return seen


def exact_records(gw, sid: str, eng: ScriptedEngine) -> list:
    """A session's TITO records, checked: each input rebuilt from TITO equals the ids the
    engine received, each output the ids it generated, and each call extends the one before
    (its parent, sharing all of the parent's input and output)."""
    gw.flush()
    recs = sorted(
        (r for r in table_to_records(gw.store.read("tito")) if r.session_id == sid),
        key=lambda r: r.seq_no,
    )
    full = reconstruct_inputs(recs)
    for r in recs:
        assert full[r.request_id].tolist() == eng.received[r.request_id]
        assert list(r.output_ids) == list(eng.requests[r.request_id].output_ids)
    for prev, cur in itertools.pairwise(recs):
        assert cur.parent_request_id == prev.request_id
        assert cur.prefix_len == len(full[prev.request_id]) + len(prev.output_ids)
        assert cur.prefix_len == len(full[prev.request_id]) + len(prev.output_ids)
    return recs
