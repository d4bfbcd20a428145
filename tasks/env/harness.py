"""The built-in agent harness: a black box that knows a base URL, an API key and its environment.

It talks to the model with the official ``openai`` client only, like any agent
framework pointed at an OpenAI-compatible endpoint; it knows nothing of gyre.
It drives every suite the same way (tasks/env/suite.py) and gives the trajectory
trees their shape:

- multi-turn: one user turn per ``env.turns`` item; tool calls are answered with
  tool messages (``env.call_tool``) for up to ``max_tool_rounds`` rounds a turn,
  then the reply is the turn's answer (``env.submit``);
- retries: a turn answered with feedback below ``retry_below`` is rolled back and
  asked again (the failed attempt stays in the tree only, as a branch);
- context resets: every ``summarize_every`` turns the history is replaced by a short
  summary (the next call shares only the system prompt: a new branch);
- context budget: when a call's context (``usage.prompt_tokens + completion_tokens``
  as the server reports it) passes ``context_tokens``, the next call's messages are
  compacted: ``summarize`` keeps the system prompt, a harness-written summary
  (``env.progress()``, no extra model call), the current turn's prompt and its last
  tool exchanges; ``truncate`` the same without the summary. Either way the new
  context no longer extends the old one: a branch.

``CommandHarness`` runs a user's agent as a subprocess instead (``cmd:`` in
``rollout.harness``): the contract's environment variables in, a JSON report out.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import signal
import tempfile
from typing import Any

from openai import NOT_GIVEN, AsyncOpenAI

from tasks.env.suite import HarnessContext, HarnessResult, SuiteError, parse_harness

log = logging.getLogger(__name__)

KEEP_EXCHANGES = 2  # tool exchanges of the current turn kept by a compaction


async def run_agent(ctx: HarnessContext) -> HarnessResult:
    """Work through the environment's turns; returns how many model calls were made."""
    env, s = ctx.env, ctx.settings
    client = AsyncOpenAI(
        base_url=ctx.base_url.rstrip("/") + "/v1",
        api_key=ctx.api_key,
        timeout=s.timeout_s,
        max_retries=2,
    )
    rounds = s.max_tool_rounds or env.max_tool_rounds
    tools = env.tools or NOT_GIVEN
    calls, last_id, compactions, used = 0, None, 0, 0
    system = {"role": "system", "content": env.system_prompt}
    history: list[dict[str, Any]] = [system]
    try:
        for i, turn in enumerate(env.turns):
            if s.summarize_every and i and i % s.summarize_every == 0:
                history = [system, _summary(env)]
            for attempt in range(s.max_attempts):
                prompt = {"role": "user", "content": turn.prompt}
                msgs = [*history, prompt]
                for tool_round in range(rounds + 1):
                    if s.context_tokens and used > s.context_tokens:
                        msgs = compact(msgs, prompt, env, s.context_policy)
                        compactions, used = compactions + 1, 0
                    resp = await client.chat.completions.create(
                        model=s.model,
                        messages=msgs,
                        tools=tools,
                        max_tokens=s.max_tokens,
                        temperature=s.temperature,
                        top_p=s.top_p,
                        seed=s.seed * 7919 + calls,
                    )
                    calls += 1
                    last_id = resp.id
                    if resp.usage is not None:
                        used = resp.usage.prompt_tokens + resp.usage.completion_tokens
                    msg = resp.choices[0].message
                    if not msg.tool_calls or tool_round == rounds:
                        break
                    msgs.append(assistant_turn(msg))
                    for tc in msg.tool_calls:
                        out = await asyncio.to_thread(
                            env.call_tool,
                            turn.turn_id,
                            tc.function.name,
                            parse_arguments(tc.function.arguments),
                            resp.id,
                        )
                        msgs.append({"role": "tool", "tool_call_id": tc.id, "content": out})
                score = env.submit(turn.turn_id, msg.content or "", resp.id)
                if score is None or score >= s.retry_below or attempt == s.max_attempts - 1:
                    history = [*msgs, assistant_turn(msg)]
                    break
                # else: roll back; the failed attempt stays only in the tree, as a branch
    finally:
        await client.close()
    return HarnessResult(calls=calls, last_request_id=last_id, compactions=compactions)


def parse_arguments(raw: str | None) -> dict[str, Any]:
    try:
        args = json.loads(raw or "{}")
    except json.JSONDecodeError:
        return {}
    return args if isinstance(args, dict) else {}


def _summary(env) -> dict[str, Any]:
    return {"role": "user", "content": f"Summary so far: {env.progress()}"}


def compact(
    msgs: list[dict[str, Any]], prompt: dict[str, Any], env, policy: str
) -> list[dict[str, Any]]:
    """System prompt [+ summary] + the current turn's prompt + its last tool exchanges.

    An exchange is an assistant message with tool calls and the tool messages answering it;
    it is never split (a tool message without its call would not render)."""
    start = max((i for i, m in enumerate(msgs) if m is prompt), default=len(msgs) - 1)
    exchanges: list[list[dict[str, Any]]] = []
    for m in msgs[start + 1 :]:
        if m.get("role") == "tool" and exchanges:
            exchanges[-1].append(m)
        else:
            exchanges.append([m])
    kept = [m for ex in exchanges[-KEEP_EXCHANGES:] for m in ex]
    head = [msgs[0]] + ([_summary(env)] if policy == "summarize" else [])
    return [*head, prompt, *kept]


def assistant_turn(msg) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
    if msg.tool_calls:
        turn["tool_calls"] = [
            {
                "id": tc.id,
                "type": "function",
                "function": {"name": tc.function.name, "arguments": tc.function.arguments},
            }
            for tc in msg.tool_calls
        ]
    return turn


class CommandHarness:
    """A user's agent as a subprocess: the black box in its purest form.

    Environment: ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``OPENAI_MODEL`` (the model name
    to send: ``gyre``), ``GYRE_TASK_FILE``, ``GYRE_WORKDIR`` (also its cwd), ``GYRE_OUTPUT``;
    see tasks/env/suite.py for the files. The tool calls and answers its report lists are
    replayed into the environment after it exits (not live while it runs).
    Killed (its whole process group) when the session's time is up.
    """

    def __init__(self, argv: list[str]):
        self.argv = list(argv)

    async def __call__(self, ctx: HarnessContext) -> HarnessResult:
        env = ctx.env
        with tempfile.TemporaryDirectory(prefix="gyre-harness-") as tmp:
            task_file, out_file = os.path.join(tmp, "task.json"), os.path.join(tmp, "output.json")
            with open(task_file, "w") as f:
                json.dump(
                    {
                        "task_id": env.task.task_id,
                        "system_prompt": env.system_prompt,
                        "tools": env.tools,
                        "turns": [{"turn_id": t.turn_id, "prompt": t.prompt} for t in env.turns],
                        "data": dict(env.task.data),
                    },
                    f,
                )
            proc_env = {
                **os.environ,
                "OPENAI_BASE_URL": ctx.base_url.rstrip("/") + "/v1",
                "OPENAI_API_KEY": ctx.api_key,
                "OPENAI_MODEL": ctx.settings.model,  # the name the gateway serves the policy as
                "GYRE_TASK_FILE": task_file,
                "GYRE_WORKDIR": env.workdir,
                "GYRE_OUTPUT": out_file,
            }
            proc = await asyncio.create_subprocess_exec(
                *self.argv,
                env=proc_env,
                cwd=env.workdir or None,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                output, _ = await proc.communicate()
            finally:
                if proc.returncode is None:  # cancelled (the session's timeout): kill it all
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    await proc.wait()
            report = _read_report(out_file)
        replay(env, report)
        if proc.returncode != 0:
            # its last words, not a traceback's middle: the last lines that say something
            said = [ln.strip() for ln in output.decode("utf-8", "replace").splitlines()]
            said = [ln for ln in said if ln.strip("^~ ")]
            tail = " / ".join(said[-3:])[-400:]
            raise RuntimeError(f"harness {self.argv[0]} exited with {proc.returncode}: {tail}")
        return HarnessResult(calls=int(report.get("calls", 0) or 0))


def _read_report(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            report = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"harness output {path} is not JSON: {exc}") from exc
    if not isinstance(report, dict):
        raise RuntimeError("harness output must be a JSON object")
    return report


def replay(env, report: dict[str, Any]) -> None:
    """Feed a subprocess harness's reported tool calls, then its answers, into ``env``."""
    turn_ids = {t.turn_id for t in env.turns}
    for turn_id, calls in (report.get("tool_calls") or {}).items():
        if turn_id not in turn_ids or not isinstance(calls, list):
            continue
        for c in calls:
            if isinstance(c, dict) and isinstance(c.get("name"), str):
                args = c.get("arguments")
                if isinstance(args, str):
                    args = parse_arguments(args)
                env.call_tool(turn_id, c["name"], args or {}, c.get("request_id"))
    for turn_id, ans in (report.get("answers") or {}).items():
        if turn_id not in turn_ids:
            continue
        text, rid = (
            (ans.get("text", ""), ans.get("request_id")) if isinstance(ans, dict) else (ans, None)
        )
        env.submit(turn_id, str(text or ""), rid)


def make_harness(spec: str):
    """``rollout.harness`` -> an async callable ``(HarnessContext) -> HarnessResult | None``."""
    kind, target, problems = parse_harness(spec)
    if problems:
        raise SuiteError(problems)
    if kind == "builtin":
        return run_agent
    if kind == "cmd":
        return CommandHarness(target)
    if inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(
        getattr(target, "__call__", None)  # noqa: B004 - an object whose __call__ is async
    ):
        return target

    async def in_thread(ctx: HarnessContext):  # a blocking harness must not stall the others
        out = await asyncio.to_thread(target, ctx)
        return await out if inspect.isawaitable(out) else out

    return in_thread
