"""Messages -> token ids with token exactness, and model text -> OpenAI message.

The gateway never re-tokenises what the model generated. For each session it keeps every
earlier call (delta-encoded like its TITO record) and, for a new chat call:

* **extend**: if the new messages are an earlier call's messages + that call's reply (same
  content / tool calls as the gateway returned) + more, the input ids are that call's input ids
  + its output ids *as generated* + the chat template's rendering of what follows. The template
  is prefix-stable, so the suffix is the text after the rendered prefix, cut right after the
  reply's ``<|im_end|>`` when the output ended with it (else right before it, so a
  length-truncated reply is closed by the template).
* **branch**: otherwise (rollback, summarised context, sub-agent) the whole conversation is
  templated; the record shares the longest common token prefix with the best earlier call.

Tools, tool calls and tool turns a template cannot show (SmolLM2's has no tool section) are
rewritten into gyre's one format before it renders (`infra.gateway.tool_prompt`), inside
``ChatTokenizer.render``: every path above sees the same rendering.

Parent selection for every call (chat, completions, generate): the earlier call of the session
whose input + output shares the longest token prefix with the new input (`infra.gateway.call_index`).

Pure module apart from loading the tokenizer: no HTTP, no event loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import uuid
from typing import Any

import numpy as np
import orjson
from pydantic import TypeAdapter, ValidationError

from infra.gateway.call_index import CHUNK, ChainMemo, ChatInput, SessionCalls, digest
from infra.gateway.token_bound import chars_per_token_cap, min_tokens
from infra.gateway.tool_prompt import TemplateTools, ToolsNotShown
from infra.gateway.wire import ChatMessage, validation_error

__all__ = [
    "CHUNK",
    "ChainMemo",
    "ChatInput",
    "ChatInputError",
    "ChatTokenizer",
    "ContextTooLong",
    "SessionCalls",
    "apply_stop",
    "build_chat_input",
    "build_token_input",
    "digest",
    "extend_chat_input",
    "normalize_messages",
    "parse_output",
    "reply_key",
    "template_messages",
    "tools_key",
]


log = logging.getLogger(__name__)


def _canon(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)


_TOOL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class ChatInputError(ValueError):
    """The messages (or tools) cannot be rendered: a 400 for the harness (``param``: the
    request field to blame, if not the messages; ``code``: OpenAI's error code, if any)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class ContextTooLong(ChatInputError):
    """The input cannot fit the model's context, known from its length before tokenizing."""

    def __init__(self, limit: int, known: int, at_least: int, chars: int):
        before = f"{known} tokens before " if known else ""
        super().__init__(
            f"This model's maximum context length is {limit} tokens; the input has at least "
            f"{known + at_least} ({before}a text of {chars} characters, at least {at_least} "
            "tokens by its length; not tokenized): shorten it",
            code="context_length_exceeded",
        )
        self.limit, self.at_least = limit, known + at_least


BIG_TEXT = 32_768  # characters: a text this long is tokenized with the GIL released


# -- tokenizer + template --------------------------------------------------------------------


class ChatTokenizer:
    """A local HF tokenizer and its chat template, compiled once."""

    def __init__(self, tokenizer_dir: str):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.backend = getattr(self.hf, "backend_tokenizer", None) or self.hf._tokenizer
        if not self.hf.chat_template:
            raise ChatInputError(f"tokenizer in {tokenizer_dir} has no chat template")
        try:  # the compiled jinja template transformers itself caches and uses
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self._template = _compile_jinja_template(self.hf.chat_template)
        except Exception:  # private API moved: go through the public one (slower)
            self._template = None
        self._template_kw = dict(self.hf.special_tokens_map)
        self.vocab_size = len(self.hf)
        self.im_end = self.hf.eos_token or "<|im_end|>"
        self.im_end_id = self.hf.convert_tokens_to_ids(self.im_end)
        self._im_end_bytes = self.im_end.encode()
        self._token_str: dict[int, str] = {}
        self._heads: dict[bytes, str] = {}  # rendered system turn (+ tools) of probes
        # what the template cannot show (tools, tool calls, ...) is rewritten before it renders
        self.shows = TemplateTools.probe(self._render_template)
        if self.shows.mode != "template":
            log.info(
                "the chat template in %s has no tool section: tools are %s",
                tokenizer_dir,
                "rendered in gyre's system-prompt format"
                if self.shows.mode == "system-prompt"
                else "refused (400): it has no system turn either",
            )
        self.fast_suffix = False
        self.message_local = self._check_message_local()
        # tokens(text) >= len(text) / token_cap (infra/gateway/token_bound.py), or None
        self.token_cap = self._check_cap(
            chars_per_token_cap(json.loads(self.backend.to_str()), self.backend.get_vocab(True))
        )
        self._encode_big = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)

    def _check_cap(self, cap: int | None) -> int | None:
        """The bound, once checked on a probe text of long and short tokens (a tokenizer that
        breaks it, whatever the reason, gets none: its texts are simply tokenized)."""
        if cap is None:
            return None
        probe = "  word, words\n\n\t" * 50 + "ä漢字 \U0001f600 <|im_end|>" * 20 + " " * 500
        return cap if len(self.encode(probe)) >= min_tokens(probe, cap) else None

    def _check_message_local(self) -> bool:
        """Does a message render the same whatever came before it (bar a leading system turn)?

        Then the text a new turn adds can be rendered from a short probe conversation instead
        of the whole (up to ~1M-token) history. Checked once on synthetic conversations.
        """
        tc = [{"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        convs = [
            [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
             {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"},
             {"role": "assistant", "content": "A2"}, {"role": "user", "content": "U3"}],
            [{"role": "user", "content": "U1"}, {"role": "assistant", "content": "", "tool_calls": tc},
             {"role": "tool", "content": "R"}, {"role": "assistant", "content": "A2"},
             {"role": "user", "content": "U3"}],
        ]  # fmt: skip
        fast = True
        tool_sets = (None,) if self.shows.mode == "refused" else (None, tools)
        try:
            for msgs in convs:
                for tl in tool_sets:
                    for k in range(1, len(msgs)):
                        if msgs[k]["role"] != "assistant":
                            continue
                        full = self._suffix(msgs, k, tl, probe=False)
                        if full is None or full != self._suffix(msgs, k, tl, probe=True):
                            return False
                        fast = fast and self._suffix_one_render(msgs, k, tl) == full[0]
        except Exception:
            return False
        self.fast_suffix = fast
        return True

    def _suffix(self, messages: list[dict], k: int, tools, *, probe: bool) -> tuple | None:
        """(text after messages[:k+1] up to the reply's end marker, marker cut) or None."""
        if probe:
            head = [messages[0]] if k > 0 and messages[0].get("role") == "system" else []
            pre, new = [*head, messages[k]], [*head, *messages[k:]]
        else:
            pre, new = messages[: k + 1], messages
        t_pre = self.render(pre, tools, False)
        t_new = self.render(new, tools, True)
        cut = t_pre.rfind(self.im_end)
        if cut < 0 or not t_new.startswith(t_pre):
            return None
        return t_new[cut:], len(t_pre) - cut

    def _suffix_one_render(self, messages: list[dict], k: int, tools) -> str | None:
        """`_suffix` of the probe conversation with one render instead of two: the rendered
        head (system turn and tools) is cached, and the reply's end marker is the first one
        after it (the caller checks the reply holds no marker text of its own)."""
        head = [messages[0]] if k > 0 and messages[0].get("role") == "system" else []
        key = _canon([head, tools or []])
        t_head = self._heads.get(key)
        if t_head is None:
            if len(self._heads) >= 256:
                self._heads.clear()
            t_head = self._heads[key] = self.render(head, tools, False)
        t_new = self.render([*head, *messages[k:]], tools, True)
        cut = t_new.find(self.im_end, len(t_head))
        if cut < 0 or not t_new.startswith(t_head):
            return None
        return t_new[cut:]

    def suffix_after_reply(self, messages: list[dict], k: int, tools) -> str | None:
        """Templated text that follows the assistant reply ``messages[k]``, starting at the
        reply's closing ``<|im_end|>`` (None if the template is not prefix-stable here)."""
        if self.fast_suffix and self._im_end_bytes not in _canon(messages[k]):
            return self._suffix_one_render(messages, k, tools)
        got = self._suffix(messages, k, tools, probe=self.message_local)
        return None if got is None else got[0]

    def render(self, messages: list[dict], tools: list | None, add_generation_prompt: bool) -> str:
        """The prompt text of a conversation: the chat template's rendering of the messages,
        with what the template cannot show by itself (tools, tool calls, tool turns, content
        parts) rewritten in gyre's one format first (`infra.gateway.tool_prompt`)."""
        try:
            messages, tools = self.shows.prepare(messages, tools)
        except ToolsNotShown as exc:
            raise ChatInputError(str(exc), param="tools") from None
        except ValueError as exc:
            raise ChatInputError(str(exc)) from None
        return self._render_template(messages, tools, add_generation_prompt)

    def _render_template(
        self, messages: list[dict], tools: list | None, add_generation_prompt: bool
    ) -> str:
        try:
            if self._template is not None:
                return self._template.render(
                    messages=messages,
                    tools=tools or None,
                    add_generation_prompt=add_generation_prompt,
                    **self._template_kw,
                )
            return self.hf.apply_chat_template(
                messages,
                tools=tools or None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as exc:  # jinja errors on odd message shapes
            raise ChatInputError(f"cannot render messages with the chat template: {exc}") from exc

    def encode(self, text: str, *, limit: int | None = None, known: int = 0) -> list[int]:
        """Token ids of ``text``. With ``limit`` (the model's context), `ContextTooLong` before
        any tokenizing when ``known`` tokens before it and the least ``text`` can take reach
        it. A long text is tokenized with the GIL released (``encode`` holds it throughout:
        seconds for a few MB, during which no other thread of the process runs)."""
        if limit and known + (n := min_tokens(text, self.token_cap)) >= limit:
            raise ContextTooLong(limit, known, n, len(text))
        if len(text) >= BIG_TEXT:
            return self._encode_big([text], add_special_tokens=False)[0].ids
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.backend.decode([int(t) for t in ids], skip_special_tokens=True)

    def token_str(self, tid: int) -> str:
        s = self._token_str.get(tid)
        if s is None:
            s = self.backend.decode([int(tid)], skip_special_tokens=False)
            self._token_str[tid] = s
        return s


# -- message normalisation -------------------------------------------------------------------


_MESSAGES = TypeAdapter(list[ChatMessage])


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Validated messages as the chat template sees them: fields that are null dropped, null
    content as "", content parts without their null fields, ``developer`` as ``system``."""
    out = []
    for m in messages:
        c = m.content
        if c is None:
            c = ""
        elif isinstance(c, list):
            c = [{k: v for k, v in part.items() if v is not None} for part in c]
        # OpenAI's `developer` role is the system prompt of newer models: one role to the
        # template, on the Chat path as on the Responses path (infra/gateway/responses.py)
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": c}
        if m.tool_calls:
            msg["tool_calls"] = [tc.model_dump(exclude_none=True) for tc in m.tool_calls]
        if m.__pydantic_extra__:
            msg.update((k, v) for k, v in m.__pydantic_extra__.items() if v is not None)
        out.append(msg)
    return out


def _norm_args(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def _norm_tool_calls(tool_calls: Any) -> list[dict]:
    if not tool_calls:
        return []
    if not isinstance(tool_calls, list):
        raise ChatInputError("tool_calls must be a list")
    out = []
    for tc in tool_calls:
        if not isinstance(tc, dict):
            raise ChatInputError("each tool call must be an object")
        fn = tc.get("function", tc)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatInputError("a tool call needs function.name")
        out.append({"name": fn["name"], "arguments": _norm_args(fn.get("arguments", {}))})
    return out


def normalize_messages(messages: Any) -> list[dict]:
    """Validate OpenAI chat messages (`ChatMessage`); return dicts the template renders."""
    if not isinstance(messages, list) or not messages:
        raise ChatInputError("messages must be a non-empty list")
    try:
        return template_messages(_MESSAGES.validate_python(messages))
    except ValidationError as exc:
        raise ChatInputError(validation_error(exc, "messages").message) from None


def message_key(msg: dict) -> bytes:
    """Canonical bytes of what the template can see of one message (ids of tool calls aside)."""
    d: dict[str, Any] = {"role": msg["role"], "content": msg.get("content") or ""}
    if msg.get("tool_calls"):
        d["tool_calls"] = _norm_tool_calls(msg["tool_calls"])
    for k in ("name", "reasoning_content"):
        if msg.get(k):
            d[k] = msg[k]
    return _canon(d)


def reply_key(content: str | None, tool_calls: list[dict] | None) -> bytes:
    """Key of an assistant reply as the gateway returned it (matches ``message_key``)."""
    d: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if tool_calls:
        d["tool_calls"] = _norm_tool_calls(tool_calls)
    return _canon(d)


def tools_key(tools: list | None) -> bytes:
    """Canonical bytes of a call's tools (what the chain keys start from)."""
    return _canon(tools or [])


def _chain(prev: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(prev + data, digest_size=16).digest()


def same_json(a: Any, b: Any) -> bool:
    """a == b with the same types at every node: ``==`` alone takes 1 == 1.0 == True, which
    canonicalise (and render) differently. Strings are leaves, so the walk costs per node,
    not per character."""
    if a != b:
        return False
    return _same_types(a, b)


def _same_types(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return all(_same_types(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return all(_same_types(x, y) for x, y in zip(a, b, strict=True))
    return True


def message_chain(
    messages: list[dict], tools: list | None, memo: ChainMemo | None = None
) -> list[bytes]:
    """keys[k] names messages[:k] (and the tools): len(messages) + 1 keys. With ``memo``, the
    keys of the longest strictly equal prefix of the memoised messages are reused, and the
    memo becomes this call's: an edited earlier message re-hashes from there on (a branch)."""
    tools = tools or []
    same = 0
    got = memo.state if memo is not None else None
    if got is not None and same_json(got[0], tools):
        _, old, old_keys = got
        n = min(len(old), len(messages))
        while same < n and same_json(old[same], messages[same]):
            same += 1
        keys = old_keys[: same + 1]
    else:
        keys = [_chain(b"tools", tools_key(tools))]
    for m in messages[same:]:
        keys.append(_chain(keys[-1], message_key(m)))
    if memo is not None:
        memo.state = (tools, messages, keys)
    return keys


# -- output parsing --------------------------------------------------------------------------


def parse_output(text: str) -> tuple[str | None, list[dict]]:
    """Model text -> (content, OpenAI tool_calls). Malformed tool-call blocks -> plain content.

    A block holds one ``{"name": ..., "arguments": ...}`` object, or a non-empty JSON list of
    them (as SmolLM2's own function-calling prompt asks).

    Content is the text outside ``<tool_call>...</tool_call>`` blocks: the text before the
    first block (trailing whitespace removed) then any non-blank text between/after blocks.
    With tool calls and no text, content is None (as OpenAI returns it).
    """
    if "<tool_call>" not in text:
        return text, []
    blocks = list(_TOOL_BLOCK.finditer(text))
    if not blocks or text.count("<tool_call>") != len(blocks):
        return text, []
    calls = []
    for b in blocks:
        try:
            obj = json.loads(b.group(1))
        except ValueError:
            return text, []
        objs = obj if isinstance(obj, list) and obj else [obj]  # a list: SmolLM2's own format
        for one in objs:
            if not isinstance(one, dict) or not isinstance(one.get("name"), str):
                return text, []
            args = one.get("arguments", {})
            if isinstance(args, str) and args:
                try:  # a text that is not JSON: no call a harness (or the gateway) could take
                    json.loads(args)
                except ValueError:
                    return text, []
            calls.append(
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {
                        "name": one["name"],
                        "arguments": args if isinstance(args, str) else json.dumps(args),
                    },
                }
            )
    pieces = [text[: blocks[0].start()].rstrip()]
    for a, b in zip(blocks, [*blocks[1:], None], strict=True):
        rest = text[a.end() : b.start() if b is not None else len(text)].strip()
        if rest:
            pieces.append(rest)
    content = "\n".join(p for p in pieces if p)
    return (content or None), calls


def apply_stop(text: str, stops: list[str]) -> int | None:
    """Index in ``text`` where the earliest stop string starts, or None."""
    best = None
    for s in stops:
        if s:
            i = text.find(s)
            if i >= 0 and (best is None or i < best):
                best = i
    return best


# -- building inputs -------------------------------------------------------------------------


def find_by_reply(
    calls: SessionCalls, keys: list[bytes], messages: list[dict]
) -> tuple[str, int] | None:
    """(call, k): the latest k where messages[:k] + messages[k] (assistant) = an earlier call's
    messages + its reply as the gateway returned it."""
    for k in range(len(messages) - 1, -1, -1):
        if messages[k].get("role") != "assistant":
            continue
        rid = calls.by_reply(keys[k], digest(message_key(messages[k])))
        if rid is not None:
            return rid, k
    return None


def _extend(
    tok: ChatTokenizer,
    calls: SessionCalls,
    messages: list[dict],
    k: int,
    rid: str,
    tools,
    limit: int | None = None,
) -> ChatInput | None:
    """Call ``rid``'s context + output as generated + the template's text after its reply
    ``messages[k]``; None when the template is not prefix-stable there."""
    text = tok.suffix_after_reply(messages, k, tools)  # starts at the reply's <|im_end|>
    if text is None:
        return None
    state = calls.calls[rid]
    if state.ended_im_end:  # the output already holds <|im_end|>: keep that id
        text = text[len(tok.im_end) :]
    suffix = np.asarray(tok.encode(text, limit=limit, known=state.context_len), dtype=np.int32)
    ids = calls.extend_on_spine(rid, suffix)  # context(rid) + suffix
    parent, n, hashes = calls.find_parent(ids, hint=rid)
    return ChatInput(ids, parent, n, "extend", hashes=hashes)


def build_chat_input(
    tok: ChatTokenizer,
    calls: SessionCalls,
    messages: list[dict],
    tools: list | None,
    limit: int | None = None,
) -> ChatInput:
    """Token ids for a chat call: extend an earlier call exactly, else template everything.
    ``limit``: the model's context (`ContextTooLong` before tokenizing what cannot fit)."""
    keys = message_chain(messages, tools, calls.chain_memo)
    found = find_by_reply(calls, keys, messages)
    after, at = found if found is not None else (None, 0)
    inp = _extend(tok, calls, messages, at, after, tools, limit) if found is not None else None
    if inp is None:
        text = tok.render(messages, tools, True)
        ids = np.asarray(tok.encode(text, limit=limit), dtype=np.int32)
        parent, k, hashes = calls.find_parent(ids)
        inp = ChatInput(ids, parent, k, "branch", hashes=hashes)
    inp.msg_key, inp.after, inp.after_at = keys[-1], after, at
    return inp


def extend_chat_input(
    tok: ChatTokenizer,
    calls: SessionCalls,
    head: dict,
    t: int,
    new: list[dict],
    tools: list | None,
    msg_key: bytes,
    limit: int | None = None,
) -> ChatInput | None:
    """`build_chat_input` for messages whose first ``t`` are the session's last chat body's
    (chain key ``msg_key``, first message ``head``) and whose others are ``new``: the same
    answer from them alone, or None when that needs the whole list (no reply of an earlier
    call among the new messages, a template whose turns depend on the history, a template
    not prefix-stable there: `build_chat_input` on the whole list decides)."""
    if not tok.message_local:
        return None
    keys = [msg_key]  # keys[j]: messages[:t + j]
    for m in new:
        keys.append(_chain(keys[-1], message_key(m)))
    for j in range(len(new) - 1, -1, -1):
        m = new[j]
        if m.get("role") != "assistant":
            continue
        rid = calls.by_reply(keys[j], digest(message_key(m)))
        if rid is None:
            continue
        # a message-local template reads messages[0] and messages[k:] only
        inp = _extend(tok, calls, [head, *new[j:]], 1, rid, tools, limit)
        if inp is None:
            return None
        inp.msg_key, inp.after, inp.after_at = keys[-1], rid, t + j
        return inp
    return None


def build_token_input(calls: SessionCalls, ids: list[int] | np.ndarray) -> ChatInput:
    """Delta encoding of a call whose input ids the harness sent (completions, generate)."""
    arr = np.asarray(ids, dtype=np.int32)
    parent, k, hashes = calls.find_parent(arr)
    return ChatInput(arr, parent, k, "tokens", hashes=hashes)
