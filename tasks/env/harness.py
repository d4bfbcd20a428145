"""The agent harness: a black box that knows a base URL, an API key and its environment.

It talks to the model with the official ``openai`` client only, like any agent
framework pointed at an OpenAI-compatible endpoint; it knows nothing of gyre.
Its behaviour gives the trajectory trees their shape:

- multi-turn: one user turn per sub-task, tool calls answered with tool turns;
- retries: a sub-task answered badly is rolled back and asked again (a branch);
- context resets: every ``summarize_every`` sub-tasks the history is replaced by
  a short summary (the next call shares only the system prompt: a new branch).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from openai import AsyncOpenAI

from tasks.env.arith import ArithEnv

log = logging.getLogger(__name__)


@dataclass
class AgentResult:
    calls: int
    last_request_id: str | None


async def run_agent(
    base_url: str,
    api_key: str,
    env: ArithEnv,
    *,
    model: str = "gyre",
    max_tokens: int = 16,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    max_attempts: int = 2,
    summarize_every: int = 0,
    retry_below: float = 1.0,
    max_tool_rounds: int = 1,
    timeout_s: float = 600.0,
) -> AgentResult:
    """Work through the environment's sub-tasks; returns how many model calls were made."""
    client = AsyncOpenAI(
        base_url=base_url.rstrip("/") + "/v1", api_key=api_key, timeout=timeout_s, max_retries=2
    )
    calls, last_id = 0, None
    system = {"role": "system", "content": env.system_prompt}
    history: list[dict[str, Any]] = [system]
    try:
        for i, sub in enumerate(env.subtasks):
            if summarize_every and i and i % summarize_every == 0:
                done = sum(1 for r in env.results.values() if r.status == "finished")
                history = [
                    system,
                    {"role": "user", "content": f"Summary so far: {done} questions answered."},
                ]
            for attempt in range(max_attempts):
                turn = [*history, {"role": "user", "content": sub.question}]
                for tool_round in range(max_tool_rounds + 1):
                    resp = await client.chat.completions.create(
                        model=model,
                        messages=turn,
                        tools=env.tools,
                        max_tokens=max_tokens,
                        temperature=temperature,
                        top_p=top_p,
                        seed=seed * 7919 + calls,
                    )
                    calls += 1
                    last_id = resp.id
                    msg = resp.choices[0].message
                    if not msg.tool_calls or tool_round == max_tool_rounds:
                        break
                    turn.append(_assistant_turn(msg))
                    for tc in msg.tool_calls:
                        try:
                            args = json.loads(tc.function.arguments or "{}")
                        except json.JSONDecodeError:
                            args = {}
                        out = env.call_tool(
                            tc.function.name, args if isinstance(args, dict) else {}
                        )
                        turn.append({"role": "tool", "tool_call_id": tc.id, "content": out})
                score = env.submit(sub.subtask_id, msg.content or "", resp.id)
                if score >= retry_below or attempt == max_attempts - 1:
                    history = [*turn, _assistant_turn(msg)]
                    break
                # else: roll back; the failed attempt stays only in the tree, as a branch
    finally:
        await client.close()
    return AgentResult(calls=calls, last_request_id=last_id)


def _assistant_turn(msg) -> dict[str, Any]:
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
