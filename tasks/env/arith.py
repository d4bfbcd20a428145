"""The bundled environment: a multi-turn arithmetic task with sub-tasks.

A task is a short list of sub-tasks ("What is 17 + 25?"). The agent answers
each in turn; it may call a ``calculator`` tool first. Each sub-task's score is
graded so that a tiny random policy still gets a learning signal: 1.0 for the
exact answer, decaying with the distance of the first number in the reply, and
0 for a reply without a number. Sub-tasks never reached count 0 with a reason.

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

_NUMBER = re.compile(r"-?\d+")

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an integer expression with + - * and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


@dataclass(frozen=True)
class Subtask:
    subtask_id: str
    question: str
    answer: int
    weight: float = 1.0


@dataclass
class SubtaskResult:
    score: float = 0.0
    at_request_id: str | None = None
    attempts: int = 0
    status: str = "unfinished"  # finished | unfinished
    reason: str = "not reached"


def make_task(task_seed: int, n_subtasks: int) -> tuple[str, list[Subtask]]:
    """A deterministic task: ``n_subtasks`` sums/products of small numbers."""
    rng = random.Random(task_seed)
    subs = []
    for i in range(n_subtasks):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        op = rng.choice("+*-")
        ans = a + b if op == "+" else a * b if op == "*" else a - b
        subs.append(Subtask(f"s{i}", f"What is {a} {op} {b}?", ans))
    return f"arith-{task_seed}", subs


def grade(text: str, answer: int) -> float:
    """1.0 for the exact answer; 1/(1+|x-answer|) for the first number x; 0 without one."""
    m = _NUMBER.search(text or "")
    if m is None:
        return 0.0
    try:
        x = int(m.group(0))
    except ValueError:
        return 0.0
    return 1.0 / (1.0 + abs(x - answer))


def calculator(expression: str) -> str:
    """The tool: integer arithmetic only, evaluated without eval()."""
    tokens = re.findall(r"\d+|[-+*()]", expression or "")
    pos = 0

    def expr() -> int:
        nonlocal pos
        v = term()
        while pos < len(tokens) and tokens[pos] in "+-":
            op = tokens[pos]
            pos += 1
            v = v + term() if op == "+" else v - term()
        return v

    def term() -> int:
        nonlocal pos
        v = atom()
        while pos < len(tokens) and tokens[pos] == "*":
            pos += 1
            v *= atom()
        return v

    def atom() -> int:
        nonlocal pos
        if pos >= len(tokens):
            raise ValueError("unexpected end")
        t = tokens[pos]
        pos += 1
        if t == "(":
            v = expr()
            if pos >= len(tokens) or tokens[pos] != ")":
                raise ValueError("missing )")
            pos += 1
            return v
        if t == "-":
            return -atom()
        return int(t)

    try:
        value = expr()
        if pos != len(tokens):
            raise ValueError("trailing input")
        return str(value)
    except (ValueError, RecursionError) as exc:
        return f"error: {exc}"


@dataclass
class ArithEnv:
    """One session's environment state: the task and what the agent has earned."""

    task_id: str
    subtasks: list[Subtask]
    results: dict[str, SubtaskResult] = field(default_factory=dict)

    @classmethod
    def create(cls, task_seed: int, n_subtasks: int) -> ArithEnv:
        task_id, subs = make_task(task_seed, n_subtasks)
        return cls(task_id, subs, {s.subtask_id: SubtaskResult() for s in subs})

    system_prompt = (
        "You are a careful assistant. Answer each question with a single number. "
        "You may call the calculator tool."
    )
    tools = TOOLS

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        if name != "calculator":
            return f"error: unknown tool {name!r}"
        return calculator(str(arguments.get("expression", "")))

    def submit(self, subtask_id: str, text: str, at_request_id: str) -> float:
        """Grade an answer; a sub-task keeps its best attempt and where it was earned."""
        sub = next(s for s in self.subtasks if s.subtask_id == subtask_id)
        res = self.results[subtask_id]
        res.attempts += 1
        score = grade(text, sub.answer)
        if res.status != "finished" or score > res.score:
            res.score, res.at_request_id = score, at_request_id
        res.status, res.reason = "finished", ""
        return score

    def mark(self, status: str, reason: str) -> None:
        """Close the session: sub-tasks not reached keep score 0 with this reason."""
        for res in self.results.values():
            if res.status == "unfinished":
                res.status, res.reason = status, reason

    def score_rows(self) -> list[dict[str, Any]]:
        return [
            {
                "subtask_id": s.subtask_id,
                "score": float(self.results[s.subtask_id].score),
                "weight": s.weight,
                "at_request_id": self.results[s.subtask_id].at_request_id,
                "source": "env",
                "status": self.results[s.subtask_id].status,
                "reason": self.results[s.subtask_id].reason,
            }
            for s in self.subtasks
        ]
