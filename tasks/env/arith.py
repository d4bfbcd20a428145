"""The ``arith`` suite: a multi-turn arithmetic task with sub-tasks (the default suite).

A task is a short list of sub-tasks ("What is 7 + 5?"). The agent answers
each in turn; it may call a ``calculator`` tool first. Each sub-task's score is
graded so that a tiny random policy still gets a learning signal: 1.0 for the
exact answer, decaying with the distance of the first number in the reply, and
0 for a reply without a number. Sub-tasks never reached count 0 with a reason.

``difficulty``: 0 = sums of 1..5; 1 (default) = ``+ - *`` of 1..9; 2 = ``+ -`` of
10..99; 3 = ``+ - *`` of 10..99. It follows the suite contract (tasks/env/suite.py).

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from tasks.env.suite import Outcome, SubtaskScore, SubtaskSpec, Task, Turn

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


_LEVELS = {0: (1, 5, "+"), 1: (1, 9, "+*-"), 2: (10, 99, "+-"), 3: (10, 99, "+*-")}


def make_task(task_seed: int, n_subtasks: int, difficulty: int = 1) -> tuple[str, list[Subtask]]:
    """A deterministic task: ``n_subtasks`` sums/differences/products of small numbers."""
    lo, hi, ops = _LEVELS[min(max(difficulty, 0), 3)]
    rng = random.Random(task_seed)
    subs = []
    for i in range(n_subtasks):
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        op = rng.choice(ops)
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
    workdir: str = ""
    seed: int = 0

    @classmethod
    def create(cls, task_seed: int, n_subtasks: int, difficulty: int = 1) -> ArithEnv:
        task_id, subs = make_task(task_seed, n_subtasks, difficulty)
        return cls(task_id, subs, cls.fresh_results(subs), seed=task_seed)

    @staticmethod
    def fresh_results(subs: list[Subtask]) -> dict[str, SubtaskResult]:
        return {s.subtask_id: SubtaskResult() for s in subs}

    def grade(self, text: str, answer: int) -> float:
        """This environment's grader (the story suite's subclass grades its own way)."""
        return grade(text, answer)

    system_prompt = (
        "You are a careful assistant. Answer each question with a single number. "
        "You may call the calculator tool."
    )
    tools = TOOLS
    max_tool_rounds = 1

    @property
    def task(self) -> Task:
        return Task(
            self.task_id,
            self.seed,
            tuple(SubtaskSpec(s.subtask_id, s.weight, s.question) for s in self.subtasks),
        )

    @property
    def turns(self) -> list[Turn]:
        return [Turn(s.subtask_id, s.question) for s in self.subtasks]

    def call_tool(
        self, turn_id: str, name: str, arguments: dict[str, Any], request_id: str | None = None
    ) -> str:
        if name != "calculator":
            return f"error: unknown tool {name!r}"
        return calculator(str(arguments.get("expression", "")))

    def progress(self) -> str:
        done = sum(1 for r in self.results.values() if r.status == "finished")
        return f"{done} questions answered."

    def close(self) -> None:
        pass

    def submit(self, subtask_id: str, text: str, at_request_id: str | None) -> float:
        """Grade an answer; a sub-task keeps its best attempt and where it was earned."""
        sub = next(s for s in self.subtasks if s.subtask_id == subtask_id)
        res = self.results[subtask_id]
        res.attempts += 1
        score = self.grade(text, sub.answer)
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


class ArithSuite:
    """The suite: tasks from seeds, one ``ArithEnv`` per session, scores as graded.

    A suite of the same shape with other tasks (``story``) changes the class attributes."""

    name = "arith"
    levels: Any = _LEVELS
    env_cls: Any = ArithEnv
    make_task = staticmethod(make_task)

    def __init__(self, subtasks: int = 3, difficulty: int = 1):
        if difficulty not in self.levels:
            raise ValueError(
                f"difficulty={difficulty}: the {self.name} suite has levels {list(self.levels)}"
            )
        self.subtasks, self.difficulty = subtasks, difficulty

    def task(self, seed: int) -> Task:
        task_id, subs = self.make_task(seed, self.subtasks, self.difficulty)
        return Task(
            task_id,
            seed,
            tuple(SubtaskSpec(s.subtask_id, s.weight, s.question) for s in subs),
            {"questions": [s.question for s in subs]},
        )

    def start(self, task: Task, workdir: str) -> ArithEnv:
        env = self.env_cls.create(task.seed, len(task.subtasks), self.difficulty)
        env.workdir = workdir
        return env

    def evaluate(self, env: ArithEnv, outcome: Outcome) -> list[SubtaskScore]:
        if outcome.status != "finished":
            env.mark(outcome.status, outcome.reason)
        env.mark("unfinished", "session ended before this sub-task")
        return [SubtaskScore(**r) for r in env.score_rows()]
