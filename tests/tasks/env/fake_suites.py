"""Suites and harnesses as a user would write them, good and bad, for the contract's tests.

``EchoSuite`` is the smallest complete suite: one sub-task per word, "say the word", scored
1 for a reply containing it. It is also the example in tasks/env/README.md.
"""

from __future__ import annotations

import random

from tasks.env.suite import (
    HarnessContext,
    HarnessResult,
    Outcome,
    SubtaskScore,
    SubtaskSpec,
    Task,
    Turn,
    close_scores,
)

WORDS = ["apple", "river", "stone", "cloud", "green", "seven"]


class EchoEnv:
    system_prompt = "Repeat the word you are given."
    tools: tuple = ()
    max_tool_rounds = 0

    def __init__(self, task: Task, workdir: str):
        self.task, self.workdir = task, workdir
        self.turns = [Turn(s.subtask_id, f"Say {s.description}.") for s in task.subtasks]
        self.earned: dict[str, SubtaskScore] = {}

    def call_tool(self, turn_id, name, arguments, request_id=None):
        return "error: no tools"

    def submit(self, turn_id, text, request_id=None):
        word = next(s.description for s in self.task.subtasks if s.subtask_id == turn_id)
        score = 1.0 if word in (text or "") else 0.0
        self.earned[turn_id] = SubtaskScore(turn_id, score, 1.0, request_id)
        return score

    def progress(self):
        return f"{len(self.earned)} words said."

    def close(self):
        pass


class EchoSuite:
    name = "echo"

    def __init__(self, subtasks: int = 2):
        self.subtasks = subtasks

    def task(self, seed: int) -> Task:
        words = random.Random(seed).sample(WORDS, self.subtasks)
        return Task(
            f"echo-{seed}", seed, tuple(SubtaskSpec(f"w{i}", 1.0, w) for i, w in enumerate(words))
        )

    def start(self, task: Task, workdir: str) -> EchoEnv:
        return EchoEnv(task, workdir)

    def evaluate(self, env: EchoEnv, outcome: Outcome) -> list[SubtaskScore]:
        return close_scores(env.task, env.earned, outcome)


class NoMethods:
    """Looks like a suite but lacks start() and evaluate()."""

    name = "half"

    def task(self, seed):
        return None


class BadInit:
    name = "bad-init"

    def __init__(self, difficulty: int = 1):
        raise ValueError(f"difficulty {difficulty} is not supported")


class BadTask(EchoSuite):
    name = "bad-task"

    def task(self, seed):
        return {"id": seed}


class BadEnv(EchoSuite):
    name = "bad-env"

    def start(self, task, workdir):
        return object()


def echo_harness(ctx: HarnessContext) -> HarnessResult:
    """A blocking user harness that answers without the model (it reads the prompts)."""
    for turn in ctx.env.turns:
        ctx.env.submit(turn.turn_id, turn.prompt, None)
    return HarnessResult(calls=0)


NOT_CALLABLE = 3


async def sleepy(ctx: HarnessContext) -> HarnessResult:
    """A harness that never finishes in time (the rollout's timeout must end it)."""
    import asyncio

    await asyncio.sleep(30)
    return HarnessResult()
