"""The story suite (issue 16): word problems graded per sub-question, checked against a
reference written from the problems' wording, and the ``smol`` preset that runs on it."""

from __future__ import annotations

import re

import pytest

from flows.config import load_config
from tasks.env.heldout import EvalConfig
from tasks.env.story import LEVELS, StoryEnv, StorySuite, extract, grade, make_task
from tasks.env.suite import Outcome, check_suite, load_suite
from tasks.trajectory.scoring import Score, aggregate


def textbook(problem: str) -> int:
    """The answer as a pupil works it out from the words: the two numbers, and the operation
    the story names ("more", "in all" add; "gives", "lost", "took" take away; "each" is
    groups of)."""
    a, b = (int(x) for x in re.findall(r"\d+", problem))
    if re.search(r"\beach\b", problem, re.IGNORECASE):
        return a * b
    if re.search(r"\b(gives|lost|took)\b", problem):
        return a - b
    assert re.search(r"\b(more|in all)\b", problem), problem
    return a + b


def test_every_problem_has_the_textbook_answer():
    seen_ops = set()
    for difficulty, (_ops, (lo, hi), (mlo, mhi)) in LEVELS.items():
        for seed in range(200):
            _, subs = make_task(seed, 3, difficulty)
            for s in subs:
                assert s.answer == textbook(s.question), (difficulty, seed, s.question)
                nums = [int(x) for x in re.findall(r"\d+", s.question)]
                limits = (mlo, mhi) if "each" in s.question.lower() else (lo, hi)
                assert all(limits[0] <= n <= limits[1] for n in nums), s.question
                assert s.answer >= 0
                seen_ops.add("*" if "each" in s.question.lower() else s.answer == nums[0] + nums[1])
    assert seen_ops == {"*", True, False}  # products, sums and differences all occur
    assert make_task(5, 3) == make_task(5, 3) and make_task(5, 3) != make_task(6, 3)


@pytest.mark.parametrize(
    "reply, answer, score",
    [
        ("Lily has 8 + 7 = 15 stickers.", 15, 1.0),
        ("8 + 7 = 15", 15, 1.0),
        # the first result counts, not what the model rambles on to
        ("Tom has 9 - 5 = 4 pens left.\nTom has 9 - 4 = 5", 4, 1.0),
        ("Tom has 9 - 5 = 2 pens left.\nTom has 2 + 5 = 7", 4, 0.0),
        ("5 cats * 4 dogs = 20 animals.", 9, 0.0),
        # no '=': the last number is the answer
        ("Sam has 9 marbles left.", 9, 1.0),
        ("Sam had 15 marbles, and he lost 6. So, Sam has 15 - 6", 9, 0.0),
        ("The answer is 42", 42, 1.0),
        ("I cannot tell.", 3, 0.0),
        ("", 3, 0.0),
        ("= 12", 12, 1.0),
        ("7 = seven; 3 + 4 = 7", 7, 1.0),
    ],
)
def test_grade_reads_the_result_of_the_calculation(reply, answer, score):
    assert grade(reply, answer) == score


def test_extract():
    assert extract("4 x 9 = 36 stickers") == 36
    assert extract("x = -3") == -3
    assert extract("two and 3 and 11") == 11
    assert extract("none") is None


def test_partial_credit_per_sub_question():
    """Three problems, a right answer, a wrong one and one never reached: 1/3 of the task,
    each sub-question scored on its own and earned at its own call."""
    suite = load_suite("story", subtasks=3, difficulty=1)
    task = suite.task(11)
    env = suite.start(task, "")
    assert isinstance(env, StoryEnv) and env.tools == [] and env.max_tool_rounds == 0
    assert [t.prompt for t in env.turns] == [s.description for s in task.subtasks]
    s0, s1, _ = env.subtasks
    right = f"{textbook(s0.question)}"
    assert env.submit("s0", f"so it is = {right}", "req-a") == 1.0
    assert env.submit("s1", f"= {s1.answer + 1}", "req-b") == 0.0
    scores = suite.evaluate(env, Outcome("timeout", "ran out of time"))
    by_id = {s.subtask_id: s for s in scores}
    assert [s.subtask_id for s in scores] == ["s0", "s1", "s2"]
    assert (by_id["s0"].score, by_id["s0"].at_request_id) == (1.0, "req-a")
    assert (by_id["s1"].score, by_id["s1"].status) == (0.0, "finished")
    assert (by_id["s2"].score, by_id["s2"].status) == (0.0, "timeout")
    rows = [Score("run", "sess", s.subtask_id, s.score, s.weight) for s in scores]
    assert aggregate(rows) == pytest.approx(1 / 3)
    assert env.call_tool("s2", "calculator", {"expression": "1+1"}).startswith("error")


def test_suite_checks_and_levels():
    assert check_suite("story", {"difficulty": 1, "subtasks": 3, "isolation": "auto"}) == []
    problems = check_suite("story", {"difficulty": 7, "subtasks": 3, "isolation": "auto"})
    assert problems and "levels [0, 1, 2]" in problems[0]
    assert StorySuite(2, 0).task(3).task_id == "story-3"


def test_smol_preset_resolves_to_the_real_model_on_the_story_suite():
    cfg = load_config(preset="smol")
    assert cfg.model.name == "smollm2-135m-instruct" and cfg.model.path is None
    r = cfg.rollout
    assert (r.suite, r.difficulty, r.subtasks, r.max_attempts) == ("story", 1, 3, 1)
    assert r.group_size >= 4 and 8 <= r.max_new_tokens <= 64 and 0 < r.temperature < 1
    # no warm start on the evaluated level: RL alone adds what the held-out curve shows
    assert not cfg.warmstart.enabled
    assert cfg.eval.every > 0 and cfg.eval.every <= cfg.train.steps
    assert cfg.eval.tasks >= 16 and cfg.eval.seed0 == EvalConfig().seed0
    assert 1e-6 <= cfg.train.lr <= 1e-4  # a pretrained model's rate, not the tiny one's 1e-3
    # the held-out tasks are the suite's own, and scored with partial credit
    suite = load_suite(r.suite, **r.suite_options())
    assert len(suite.task(cfg.eval.seed0).subtasks) == 3
