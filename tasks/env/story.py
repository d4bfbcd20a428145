"""The ``story`` suite: arithmetic word problems, one per turn, for a small real model.

Made for SmolLM2-135M-Instruct (``--preset smol``): a task is ``subtasks`` short word
problems ("Lily has 8 stickers. She gets 7 more. How many stickers does Lily have?"), asked
one per user turn in one conversation. The system prompt shows the answer format by one
worked example ("Ann has 2 cups and gets 3 more. -> 2 + 3 = 5"), which the model partly
follows on its own: it writes ``8 + 7 = 15`` often, but also picks the wrong operation
("5 cats * 4 dogs = 20"), miscounts ("9 - 5 = 2") or talks around the question until its
token budget runs out. Each problem is a sub-task scored on its own (partial credit per
sub-question), so a task's reward is the fraction of its problems answered right.

The answer (``extract``): the first number after an ``=`` in the reply; a reply without
``=`` answers with its last number; a reply without a number answers nothing. Score
(``grade``): 1.0 for the right number, else 0.0 (the partial credit is across sub-questions,
not inside one; "close" has no meaning for a count of apples).

No tool: the model never emits a tool call unprompted (its chat template has no tool
section, issue 16), so a calculator would only lengthen its prompt; what RL has to improve
is reading the problem (which numbers, which operation), the arithmetic and stopping.

``difficulty``: 0 = add / take away with 1..9; 1 (default) = add / take away / groups-of
(products) with 2..9 and sums of 2..20; 2 = add / take away with 10..49. Tasks come from
their seed (names, things, numbers, templates), nothing is downloaded.

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from tasks.env.arith import ArithEnv, ArithSuite, Subtask

SYSTEM_PROMPT = (
    "Solve each problem in one line: write the calculation, then the result. "
    "Example: Ann has 2 cups and gets 3 more. -> 2 + 3 = 5"
)

NAMES = (
    "Mia", "Tom", "Lily", "Ben", "Ava", "Sam", "Zoe", "Max", "Emma", "Leo",
    "Ella", "Jack", "Nora", "Finn", "Ruby", "Owen",
)  # fmt: skip
SHE = {"Mia", "Lily", "Ava", "Zoe", "Emma", "Ella", "Nora", "Ruby"}
THINGS = (
    "apples", "pens", "stickers", "marbles", "cards", "coins", "books", "shells",
    "stamps", "cookies", "balloons", "pencils",
)  # fmt: skip
BOXES = (("bag", "bags"), ("box", "boxes"), ("jar", "jars"), ("basket", "baskets"))

# (kind, template); {n} a name, {p} its pronoun, {o} another name, {t} the things,
# {a} {b} the numbers, {c}/{cs} a container and its plural
TEMPLATES = {
    "+": (
        "{n} has {a} {t}. {P} gets {b} more. How many {t} does {n} have now?",
        "There are {a} {t} in a box and {b} {t} on the table. How many {t} are there in all?",
        "{n} found {a} {t} and then {b} more. How many {t} did {n} find?",
    ),
    "-": (
        "{n} has {a} {t}. {P} gives {b} to {o}. How many {t} does {n} have left?",
        "{n} had {a} {t} and lost {b}. How many {t} does {n} have now?",
        "There were {a} {t} on the table. {o} took {b}. How many {t} are on the table now?",
    ),
    "*": (
        "Each {c} has {a} {t}. How many {t} are in {b} {cs}?",
        "{n} has {b} {cs} with {a} {t} in each. How many {t} does {n} have?",
    ),
}

# difficulty -> (operations, numbers for + and -, numbers for *)
LEVELS: dict[int, tuple[str, tuple[int, int], tuple[int, int]]] = {
    0: ("+-", (1, 9), (2, 5)),
    1: ("+-*", (2, 20), (2, 9)),
    2: ("+-", (10, 49), (2, 9)),
}

_NUMBER = re.compile(r"-?\d+")
_AFTER_EQ = re.compile(r"=\s*(-?\d+)")


def make_problem(rng: random.Random, difficulty: int) -> tuple[str, int]:
    """One word problem and its answer (a non-negative integer)."""
    ops, (lo, hi), (mlo, mhi) = LEVELS[difficulty]
    op = rng.choice(ops)
    name = rng.choice(NAMES)
    other = rng.choice([n for n in NAMES if n != name])
    things = rng.choice(THINGS)
    box, boxes = rng.choice(BOXES)
    if op == "*":
        a, b = rng.randint(mlo, mhi), rng.randint(mlo, mhi)
        answer = a * b
    else:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if op == "-" and a < b:
            a, b = b, a
        answer = a + b if op == "+" else a - b
    pron = "She" if name in SHE else "He"
    text = rng.choice(TEMPLATES[op]).format(
        n=name, P=pron, o=other, t=things, a=a, b=b, c=box, cs=boxes
    )
    return text, answer


def make_task(task_seed: int, n_subtasks: int, difficulty: int = 1) -> tuple[str, list[Subtask]]:
    """A deterministic task: ``n_subtasks`` word problems from ``task_seed``."""
    rng = random.Random(task_seed)
    subs = []
    for i in range(n_subtasks):
        text, answer = make_problem(rng, difficulty)
        subs.append(Subtask(f"s{i}", text, answer))
    return f"story-{task_seed}", subs


def extract(text: str) -> int | None:
    """The number a reply answers with: the first after an ``=``, else the last; None
    without a number."""
    m = _AFTER_EQ.search(text or "")
    if m is not None:
        return int(m.group(1))
    found = _NUMBER.findall(text or "")
    return int(found[-1]) if found else None


def grade(text: str, answer: int) -> float:
    """1.0 when the reply answers ``answer`` (``extract``), else 0.0."""
    return 1.0 if extract(text) == answer else 0.0


class StoryEnv(ArithEnv):
    """One session: the arith environment's bookkeeping, word problems, no tool."""

    system_prompt = SYSTEM_PROMPT
    tools: ClassVar[list[dict[str, Any]]] = []
    max_tool_rounds = 0

    @classmethod
    def create(cls, task_seed: int, n_subtasks: int, difficulty: int = 1) -> StoryEnv:
        task_id, subs = make_task(task_seed, n_subtasks, difficulty)
        return cls(task_id, subs, cls.fresh_results(subs), seed=task_seed)

    def grade(self, text: str, answer: int) -> float:
        return grade(text, answer)

    def call_tool(
        self, turn_id: str, name: str, arguments: dict[str, Any], request_id: str | None = None
    ) -> str:
        return f"error: no tools in this task (called {name!r})"


class StorySuite(ArithSuite):
    """The suite: word problems from seeds, one ``StoryEnv`` per session."""

    name = "story"
    levels = LEVELS
    env_cls = StoryEnv
    make_task = staticmethod(make_task)
