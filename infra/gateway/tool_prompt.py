"""Tools on a chat template that cannot show them: one documented format, rendered here.

Many chat templates have no tool section (SmolLM2's: a ChatML template with a default system
prompt and nothing else): ``tools=[...]`` renders as if there were none, and an assistant turn's
``tool_calls`` vanish. The gateway never lets that happen silently. What a template shows is
found once per tokenizer by rendering probes with and without a probe tool / tool call /
tool turn / content part / system turn and comparing (`TemplateTools.probe`); whatever the
template does not show, the messages are rewritten into before it renders them
(`TemplateTools.prepare`):

* **tools** (the template has no tool section): a section appended to the system turn, after
  the caller's system message or, without one, after the template's own default system prompt
  (SmolLM2's "You are a helpful AI assistant named SmolLM, ..."; found by probe, so a
  conversation with tools keeps it)::

      <system text>

      # Tools

      You may call one or more functions to assist with the user query.

      You are provided with function signatures within <tools></tools> XML tags:
      <tools>
      {"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}
      </tools>

      For each function call, return a json object with function name and arguments within
      <tool_call></tool_call> XML tags:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

  (the Hermes / Qwen2.5 format; the model's reply is parsed back by
  `infra.gateway.chat.parse_output` into OpenAI ``tool_calls``). A template that cannot show
  a system turn either has no place for the section: a call with tools is refused with a 400
  naming ``tools``, never answered as if there were none.
* **tool calls of earlier assistant turns** (the template drops ``tool_calls``): appended to
  the turn's text as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks,
  one per call, separated by newlines (the format the model is asked to answer in).
* **tool results** (the template cannot show a ``tool`` turn): consecutive tool messages become
  one user turn of ``<tool_response>\\n...\\n</tool_response>`` blocks.
* **content parts** (the template concatenates ``content`` as a string): their texts joined.

The rewrite is a pure function of (messages, tools), applied inside the tokenizer's ``render``,
so the token-exactness machinery (prefix-stable suffixes, probes, message locality, extend of
earlier calls with their generated ids) sees one template and holds as before.

Pure module: json only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["TemplateTools", "ToolsNotShown", "content_text", "inline_tool_calls", "tool_section"]

Render = Callable[[list[dict], "list | None", bool], str]

TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

_PROBE_TOOL = "gyre_probe_tool_5c1e"
_PROBE_CALL = "gyre_probe_call_9a4d"
_PROBE_TEXT = "gyre probe text 3f7b"
_PROBE_SYSTEM = "gyre probe system 81d2"
_PROBE_RESULT = "gyre probe result 6e0a"


class ToolsNotShown(ValueError):
    """The template can show neither tools nor a system turn to carry them."""


def tool_section(tools: list) -> str:
    """The tool section of the system turn: each tool's JSON on its own line, keys in the
    order the caller gave them."""
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return TOOLS_HEAD + lines + TOOLS_TAIL


def _args(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return {} if args is None else args


def inline_tool_calls(text: str, tool_calls: list) -> str:
    """An assistant turn's text followed by its tool calls as ``<tool_call>`` blocks."""
    blocks = []
    for tc in tool_calls:
        fn = tc.get("function", tc) if isinstance(tc, dict) else {}
        call = {"name": fn.get("name"), "arguments": _args(fn.get("arguments"))}
        blocks.append("<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>")
    return "\n".join([text, *blocks] if text else blocks)


def content_text(content: Any) -> str:
    """A message's content as one string (the texts of its parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(
                f"content part {kind!r} cannot be shown by this model's chat template "
                "(it renders text only)"
            )
        out.append(part["text"])
    return "".join(out)


def _shows(render: Render, messages: list[dict], tools: list | None, needle: str) -> bool:
    try:
        return needle in render(messages, tools, False)
    except Exception:
        return False


@dataclass(frozen=True)
class TemplateTools:
    """What a chat template shows by itself; `prepare` rewrites what it does not."""

    shows_tools: bool  # a tool section for ``tools``
    shows_calls: bool  # an assistant turn's ``tool_calls``
    shows_tool_turns: bool  # a message of role ``tool``
    shows_parts: bool  # content given as a list of text parts
    shows_system: bool  # a system turn
    default_system: str | None  # the system text rendered when a conversation has none

    @property
    def mode(self) -> str:
        """How tools reach the model: ``template`` | ``system-prompt`` | ``refused``."""
        if self.shows_tools:
            return "template"
        return "system-prompt" if self.shows_system else "refused"

    @property
    def rewrites(self) -> bool:
        return not (
            self.shows_tools and self.shows_calls and self.shows_tool_turns and self.shows_parts
        )

    @classmethod
    def probe(cls, render: Render) -> TemplateTools:
        """Render probe conversations (``render`` raising on what the template rejects)."""
        user = {"role": "user", "content": _PROBE_TEXT}
        tool = {"type": "function", "function": {"name": _PROBE_TOOL, "parameters": {}}}
        call = {"type": "function", "function": {"name": _PROBE_CALL, "arguments": "{}"}}
        asst = {"role": "assistant", "content": "", "tool_calls": [call]}
        reply = {"role": "assistant", "content": "A"}
        result = {"role": "tool", "tool_call_id": "c1", "content": _PROBE_RESULT}
        parts = {"role": "user", "content": [{"type": "text", "text": _PROBE_TEXT}]}
        system = {"role": "system", "content": _PROBE_SYSTEM}
        return cls(
            shows_tools=_shows(render, [user], [tool], _PROBE_TOOL),
            shows_calls=_shows(render, [user, asst], None, _PROBE_CALL),
            shows_tool_turns=_shows(render, [user, reply, result], None, _PROBE_RESULT),
            shows_parts=_shows(render, [parts], None, _PROBE_TEXT),
            shows_system=_shows(render, [system, user], None, _PROBE_SYSTEM),
            default_system=_default_system(render, system, user),
        )

    def prepare(self, messages: list[dict], tools: list | None) -> tuple[list[dict], list | None]:
        """(messages, tools) the template renders: what it cannot show rewritten (module doc).
        Raises `ToolsNotShown` (tools on a template with no place for them) or `ValueError`."""
        if not self.rewrites:
            return messages, tools
        msgs: list[dict] = []
        after_tool = False  # the last message was a tool result turned into a user turn
        for m in messages:
            if not self.shows_parts and not isinstance(m.get("content"), str):
                m = {**m, "content": content_text(m.get("content"))}
            if not self.shows_calls and m.get("role") == "assistant" and m.get("tool_calls"):
                text = inline_tool_calls(content_text(m.get("content")), m["tool_calls"])
                m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}
            if not self.shows_tool_turns and m.get("role") == "tool":
                block = f"<tool_response>\n{content_text(m.get('content'))}\n</tool_response>"
                if after_tool:  # consecutive results: one user turn
                    msgs[-1] = {"role": "user", "content": msgs[-1]["content"] + "\n" + block}
                else:
                    msgs.append({"role": "user", "content": block})
                after_tool = True
                continue
            after_tool = False
            msgs.append(m)
        if tools and not self.shows_tools:
            if not self.shows_system:
                raise ToolsNotShown(
                    "this model's chat template has no tool section and no system turn to "
                    "carry one, so tools cannot be shown to the model; call without tools"
                )
            section = tool_section(tools)
            if msgs and msgs[0].get("role") == "system":
                text = content_text(msgs[0].get("content"))
                msgs[0] = {**msgs[0], "content": f"{text}\n\n{section}" if text else section}
            else:
                base = self.default_system
                msgs.insert(
                    0, {"role": "system", "content": f"{base}\n\n{section}" if base else section}
                )
            tools = None
        return msgs, tools


def _default_system(render: Render, system: dict, user: dict) -> str | None:
    """The system text a template renders for a conversation without a system message: the
    rendering of [user] read against that of [system X, user] (None: no default)."""
    try:
        with_sys = render([system, user], None, False)
        without = render([user], None, False)
    except Exception:
        return None
    i = with_sys.find(_PROBE_SYSTEM)
    if i < 0:
        return None
    pre, post = with_sys[:i], with_sys[i + len(_PROBE_SYSTEM) :]
    if len(without) < len(pre) + len(post) or not without.startswith(pre):
        return None
    if not without.endswith(post):
        return None
    return without[len(pre) : len(without) - len(post)]
