"""The ``tools`` suite: multi-turn tool use a tiny model can learn in minutes.

An episode is a row of boxes, each with a colour, a ``code`` and a ``size`` (random numbers
from the task's seed), and ``subtasks`` questions about them, one user turn each::

    user:      What is the code of the red box?
    assistant: <tool_call>{"name": "get_code", "arguments": {"box": "red"}}</tool_call>
    tool:      47
    assistant: 47

The agent cannot know the numbers without the tools: it must pick the tool the question
names, copy the colour into the call, and copy the tool's result into its answer. The
format is short and fixed, so a short supervised warm start (``demonstrations``) teaches it
and reinforcement learning sharpens the copying.

Partial scores (dense by design), per sub-task, for the best of its attempts:

- calls, weight ``W_CALL`` = 0.5: for each call the question needs, 0.5 if a call with the
  right tool name was made in the attempt and 0.5 more if one also had the right argument
  (averaged over the needed calls);
- answer, weight ``W_ANSWER`` = 0.5: 1 for the exact number; otherwise the fraction of
  digit positions of the first number in the reply that match the answer's (``"48"`` for
  ``47``: 0.5); 0 without a number.

Difficulty (``difficulty``):

| level | tools | digits | boxes | questions |
| --- | --- | --- | --- | --- |
| 0 | get_code | 2 | 8 | code of a box |
| 1 | get_code, get_size | 2 | 8 | code or size (pick the tool) |
| 2 | get_code, get_size | 3 | 15 | code or size |
| 3 | get_code, get_size, get_next | 3 | 15 | also "the code of the box after X" (two calls) |

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

from tasks.env.suite import Outcome, SubtaskScore, SubtaskSpec, Task, Turn, close_scores

W_CALL = 0.5
W_ANSWER = 0.5

COLORS = (
    "red", "blue", "green", "black", "white", "gray", "pink", "gold",
    "orange", "yellow", "brown", "purple", "silver", "violet", "indigo",
)  # fmt: skip

SYSTEM_PROMPT = "Answer each question with a number. Use the tools to look it up."


def _tool(name: str, description: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"box": {"type": "string"}},
                "required": ["box"],
            },
        },
    }


TOOL_SCHEMAS = {
    "get_code": _tool("get_code", "The code of a box."),
    "get_size": _tool("get_size", "The size of a box."),
    "get_next": _tool("get_next", "The box after a box."),
}


@dataclass(frozen=True)
class Level:
    tools: tuple[str, ...]
    digits: int
    boxes: int
    chain: bool  # two-call questions mixed in
    rounds: int  # tool rounds a turn may take


LEVELS = {
    0: Level(("get_code",), 2, 8, False, 2),
    1: Level(("get_code", "get_size"), 2, 8, False, 2),
    2: Level(("get_code", "get_size"), 3, 15, False, 2),
    3: Level(("get_code", "get_size", "get_next"), 3, 15, True, 3),
}


@dataclass(frozen=True)
class Question:
    subtask_id: str
    text: str
    answer: str
    calls: tuple[tuple[str, str], ...]  # (tool, box) the question needs, in order


def make_episode(seed: int, n: int, difficulty: int) -> tuple[dict[str, dict], list[Question]]:
    """Boxes (colour -> code, size, next) and ``n`` questions, all from ``seed``."""
    lv = LEVELS[difficulty]
    rng = random.Random(seed)
    colors = rng.sample(COLORS[: lv.boxes], lv.boxes)
    lo, hi = 10 ** (lv.digits - 1), 10**lv.digits - 1
    boxes = {
        c: {"code": rng.randint(lo, hi), "size": rng.randint(lo, hi), "next": colors[(i + 1) % len(colors)]}
        for i, c in enumerate(colors)
    }  # fmt: skip
    questions = []
    for i in range(n):
        c = rng.choice(colors)
        kinds = [t for t in lv.tools if t != "get_next"] + (["chain"] if lv.chain else [])
        kind = rng.choice(kinds)
        if kind == "chain":
            nxt = boxes[c]["next"]
            q = Question(
                f"q{i}",
                f"What is the code of the box after the {c} box?",
                str(boxes[nxt]["code"]),
                (("get_next", c), ("get_code", nxt)),
            )
        else:
            what = kind.removeprefix("get_")
            q = Question(
                f"q{i}", f"What is the {what} of the {c} box?", str(boxes[c][what]), ((kind, c),)
            )
        questions.append(q)
    return boxes, questions


_NUMBER = re.compile(r"\d+")


def answer_score(text: str, answer: str) -> float:
    """1 for the exact number; else matching digit positions / the longer length; 0 without."""
    m = _NUMBER.search(text or "")
    if m is None:
        return 0.0
    got = m.group(0)
    if got == answer:
        return 1.0
    same = sum(a == b for a, b in zip(got, answer, strict=False))
    return same / max(len(got), len(answer))


def calls_score(made: list[tuple[str, str]], needed: tuple[tuple[str, str], ...]) -> float:
    """Mean over needed calls of 0.5 (a call to that tool) + 0.5 (with the right box)."""
    total = 0.0
    for tool, box in needed:
        total += 0.5 * any(t == tool for t, _ in made) + 0.5 * ((tool, box) in made)
    return total / len(needed)


@dataclass
class BestAttempt:
    """The best attempt at one question so far (the tools and logbook suites' turns)."""

    score: float = -1.0  # below any real score: the first attempt always counts
    at_request_id: str | None = None
    attempts: int = 0


@dataclass
class ToolsEnv:
    """One session: the boxes, the questions, and the best attempt at each."""

    task: Task
    boxes: dict[str, dict]
    questions: list[Question]
    level: Level
    workdir: str = ""
    system_prompt: str = SYSTEM_PROMPT
    results: dict[str, BestAttempt] = field(default_factory=dict)
    pending: dict[str, list[tuple[str, str, str | None]]] = field(default_factory=dict)

    @property
    def tools(self) -> list[dict[str, Any]]:
        return [TOOL_SCHEMAS[t] for t in self.level.tools]

    @property
    def turns(self) -> list[Turn]:
        return [Turn(q.subtask_id, q.text) for q in self.questions]

    @property
    def max_tool_rounds(self) -> int:
        return self.level.rounds

    def call_tool(
        self, turn_id: str, name: str, arguments: dict[str, Any], request_id: str | None = None
    ) -> str:
        box = str(arguments.get("box", "")).strip().lower()
        self.pending.setdefault(turn_id, []).append((name, box, request_id))
        if name not in self.level.tools:
            return f"error: no tool {name!r}"
        if box not in self.boxes:
            return f"error: no {box or 'unnamed'} box"
        value = self.boxes[box][name.removeprefix("get_")]
        return str(value)

    def submit(self, turn_id: str, text: str, request_id: str | None = None) -> float:
        """Grade one attempt (its tool calls since the last submit and this reply)."""
        q = next(q for q in self.questions if q.subtask_id == turn_id)
        made = self.pending.pop(turn_id, [])
        c = calls_score([(t, b) for t, b, _ in made], q.calls)
        a = answer_score(text, q.answer)
        score = W_CALL * c + W_ANSWER * a
        res = self.results.setdefault(turn_id, BestAttempt())
        res.attempts += 1
        if score > res.score:
            at = request_id
            if a == 0.0 and c > 0.0:  # only the calls earned something: credit the last one
                at = next((r for t, b, r in reversed(made) if (t, b) in q.calls), request_id)
            res.score, res.at_request_id = score, at
        return score

    def progress(self) -> str:
        return f"{len(self.results)} of {len(self.questions)} questions answered."

    def close(self) -> None:
        pass


class ToolsSuite:
    """Tasks from seeds (``subtasks`` questions at ``difficulty``), graded as answered."""

    name = "tools"

    def __init__(self, subtasks: int = 3, difficulty: int = 1):
        if difficulty not in LEVELS:
            raise ValueError(f"difficulty={difficulty}: the tools suite has levels {list(LEVELS)}")
        self.subtasks, self.difficulty = subtasks, difficulty

    def task(self, seed: int) -> Task:
        boxes, questions = make_episode(seed, self.subtasks, self.difficulty)
        return Task(
            f"tools-d{self.difficulty}-{seed}",
            seed,
            tuple(SubtaskSpec(q.subtask_id, 1.0, q.text) for q in questions),
            {"boxes": boxes, "difficulty": self.difficulty},
        )

    def start(self, task: Task, workdir: str) -> ToolsEnv:
        boxes, questions = make_episode(task.seed, len(task.subtasks), self.difficulty)
        return ToolsEnv(task, boxes, questions, LEVELS[self.difficulty], workdir)

    def evaluate(self, env: ToolsEnv, outcome: Outcome) -> list[SubtaskScore]:
        earned = {
            sid: SubtaskScore(sid, r.score, 1.0, r.at_request_id, "finished", "", "env")
            for sid, r in env.results.items()
        }
        return close_scores(env.task, earned, outcome)

    def demonstrations(self, n: int, seed: int) -> list[dict[str, Any]]:
        """``n`` correct transcripts (tasks ``seed``, ``seed + 1``, ...) for a supervised warm
        start: ``{"messages": [...], "tools": [...]}``, OpenAI chat messages exactly as the
        built-in harness sends them (assistant tool calls with JSON ``arguments`` strings,
        tool results as ``tool`` messages), to be rendered with the tokenizer's chat template
        and ``tools``; each one scores 1.0 on every sub-task (checked here)."""
        out = []
        for k in range(n):
            task = self.task(seed + k)
            env = self.start(task, "")
            msgs: list[dict[str, Any]] = [{"role": "system", "content": env.system_prompt}]
            for q in env.questions:
                msgs.append({"role": "user", "content": q.text})
                for j, (tool, box) in enumerate(q.calls):
                    cid = f"call_{q.subtask_id}_{j}"
                    msgs.append(
                        {
                            "role": "assistant",
                            "content": "",
                            "tool_calls": [
                                {
                                    "id": cid,
                                    "type": "function",
                                    "function": {
                                        "name": tool,
                                        "arguments": json.dumps({"box": box}),
                                    },
                                }
                            ],
                        }
                    )
                    result = env.call_tool(q.subtask_id, tool, {"box": box})
                    msgs.append({"role": "tool", "tool_call_id": cid, "content": result})
                msgs.append({"role": "assistant", "content": q.answer})
                assert env.submit(q.subtask_id, q.answer) == 1.0, "a demonstration must be correct"
            out.append({"messages": msgs, "tools": env.tools})
        return out


def demonstrations(n: int, seed: int, *, difficulty: int = 0, subtasks: int = 3) -> list[dict]:
    """Module-level shortcut: ``ToolsSuite(subtasks, difficulty).demonstrations(n, seed)``."""
    return ToolsSuite(subtasks=subtasks, difficulty=difficulty).demonstrations(n, seed)
