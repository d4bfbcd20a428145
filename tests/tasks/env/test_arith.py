from tasks.env.arith import ArithEnv, calculator, grade, make_task


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
