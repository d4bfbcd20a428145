import random

from tasks.env.arith import ArithEnv, ArithSuite, calculator, grade, make_task
from tasks.env.suite import Outcome


def test_task_is_deterministic():
    assert make_task(7, 3) == make_task(7, 3)
    assert make_task(7, 3) != make_task(8, 3)
    _, subs = make_task(1, 4)
    assert len(subs) == 4 and all(s.question.startswith("What is") for s in subs)


def test_grade():
    assert grade("12", 12) == 1.0
    assert grade("the answer is 10, not 12", 12) == 1 / 3
    assert grade("-3", -3) == 1.0
    assert grade("no number", 5) == 0.0
    assert grade("", 5) == 0.0


def test_calculator():
    assert calculator("2+3*4") == "14"
    assert calculator("(2+3)*4") == "20"
    assert calculator("-2*3") == "-6"
    assert calculator("2+").startswith("error")
    assert calculator("__import__('os')").startswith("error")


def test_env_keeps_best_attempt_and_marks_unreached():
    env = ArithEnv.create(3, 3)
    s0, s1, _ = env.subtasks
    assert env.submit(s0.subtask_id, "nothing", "req-1") == 0.0
    assert env.submit(s0.subtask_id, str(s0.answer), "req-2") == 1.0
    env.submit(s0.subtask_id, "nothing", "req-3")
    env.submit(s1.subtask_id, str(s1.answer + 1), "req-4")
    env.mark("timeout", "ran out of time")
    rows = {r["subtask_id"]: r for r in env.score_rows()}
    assert rows["s0"]["score"] == 1.0 and rows["s0"]["at_request_id"] == "req-2"
    assert rows["s1"]["score"] == 0.5 and rows["s1"]["status"] == "finished"
    assert rows["s2"] == {
        **rows["s2"],
        "score": 0.0,
        "status": "timeout",
        "reason": "ran out of time",
        "at_request_id": None,
    }
    env.mark("unfinished", "later mark does not override")
    assert {r["subtask_id"]: r for r in env.score_rows()}["s2"]["status"] == "timeout"


def _original_questions(seed: int, n: int) -> list[str]:
    """The generator the default run used before suites existed, written out again."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        out.append(f"What is {a} {rng.choice('+*-')} {b}?")
    return out


def test_suite_tasks_follow_the_seed_and_the_old_generator():
    suite = ArithSuite(subtasks=3)
    assert suite.task(5) == suite.task(5) and suite.task(5) != suite.task(6)
    # difficulty 1 (the default) is exactly the generator `gyre run --preset tiny` used
    for seed in range(20):
        assert [s.description for s in suite.task(seed).subtasks] == _original_questions(seed, 3)
    _, easy = make_task(5, 8, difficulty=0)
    assert all("+" in s.question and s.answer <= 10 for s in easy)


def test_suite_evaluate_marks_by_outcome():
    suite = ArithSuite(subtasks=3)
    env = suite.start(suite.task(2), "")
    s0 = env.turns[0]
    assert env.call_tool(s0.turn_id, "calculator", {"expression": "2*3"}) == "6"
    assert env.call_tool(s0.turn_id, "rm", {}) == "error: unknown tool 'rm'"
    env.submit(s0.turn_id, str(env.subtasks[0].answer), "req-9")
    rows = suite.evaluate(env, Outcome("failed", "harness crashed"))
    assert [(r.score, r.status, r.at_request_id) for r in rows] == [
        (1.0, "finished", "req-9"),
        (0.0, "failed", None),
        (0.0, "failed", None),
    ]
    assert rows[1].reason == "harness crashed" and rows[0].source == "env"
    fresh = suite.start(suite.task(2), "")
    assert {r.status for r in suite.evaluate(fresh, Outcome("finished"))} == {"unfinished"}
