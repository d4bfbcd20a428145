"""The logbook suite (issue 24's long-horizon environment): partial scoring by hand,
determinism per seed, page and tool outputs, and its size on the tiny tokenizer."""

from __future__ import annotations

import pytest

from tasks.env.logbook import GREP_MAX, LINES, LogbookSuite, make_log
from tasks.env.suite import Outcome, check_suite, load_suite


def _status(line: str) -> str:
    return line.split("status=")[1].split()[0]


def test_partial_scores_by_hand():
    suite = LogbookSuite(subtasks=5, difficulty=0)
    env = suite.start(suite.task(3), "")
    qs = env.log.questions
    # the answer, read off the page text itself (not from Question.answer)
    truth = [
        _status(next(ln for ln in env.log.pages[q.about] if f"req={q.req} " in ln)) for q in qs
    ]
    assert [q.answer for q in qs] == truth
    a0, a1 = truth[0], truth[1]
    wrong_last = a1[:-1] + str((int(a1[-1]) + 1) % 10)  # 2 of 3 digits right
    assert env.submit("q0", f"status {a0}", "req-0") == 1.0
    assert env.submit("q1", wrong_last, "req-1a") == pytest.approx(2 / 3)
    assert env.submit("q1", "no idea", "req-1b") == 0.0  # worse: the earlier best stays
    assert env.submit("q2", "nothing here", "req-2") == 0.0
    scores = suite.evaluate(env, Outcome("finished", calls=4))
    got = [(s.subtask_id, s.score, s.weight, s.at_request_id, s.status) for s in scores]
    assert got == [
        ("q0", 1.0, 1.0, "req-0", "finished"),
        ("q1", pytest.approx(2 / 3), 1.0, "req-1a", "finished"),
        ("q2", 0.0, 1.0, "req-2", "finished"),
        ("q3", 0.0, 1.0, None, "unfinished"),
        ("q4", 0.0, 1.0, None, "unfinished"),
    ]
    timed = suite.evaluate(env, Outcome("timeout", "ran out"))
    assert [s.status for s in timed[3:]] == ["timeout", "timeout"]


def test_deterministic_per_seed():
    a, b, c = make_log(7, 20), make_log(7, 20), make_log(8, 20)
    assert a == b
    assert a != c
    s = LogbookSuite(subtasks=20)
    assert s.task(7) == s.task(7)
    assert [t.prompt for t in s.start(s.task(7), "").turns] == [
        t.prompt for t in s.start(s.task(7), "").turns
    ]


def test_pages_questions_and_tools():
    n = 30
    log = make_log(1, n)
    assert len(log.pages) == n and all(len(p) == LINES[1] for p in log.pages)
    reqs = [ln.split("req=")[1].split()[0] for p in log.pages for ln in p]
    assert len(set(reqs)) == len(reqs)  # a request id names one line
    for q in log.questions:
        assert q.page - 8 <= q.about <= q.page
    suite = LogbookSuite(subtasks=n)
    env = suite.start(suite.task(1), "")
    turns = env.turns
    assert len(turns) == n and all(
        t.prompt.startswith(f"Log page {i + 1} of {n}:") for i, t in enumerate(turns)
    )
    assert env.log.page_text(4) in turns[4].prompt
    assert env.max_tool_rounds >= 1 and {t["function"]["name"] for t in env.tools} == {
        "read_page",
        "grep",
    }
    # tools see only pages shown so far (up to the turn's page)
    assert (
        env.call_tool("q4", "read_page", {"n": 5}) == f"Log page 5 of {n}:\n{env.log.page_text(4)}"
    )
    assert env.call_tool("q4", "read_page", {"n": 6}).startswith("error")
    assert env.call_tool("q4", "read_page", {"n": "x"}).startswith("error")
    hits = env.call_tool("q4", "grep", {"pattern": "status=5"}).splitlines()
    want = [ln for p in env.log.pages[:5] for ln in p if "status=5" in ln]
    assert want and hits[: min(len(want), GREP_MAX)] == want[:GREP_MAX]
    tail = [f"({len(want) - GREP_MAX} more lines)"] if len(want) > GREP_MAX else []
    assert hits[min(len(want), GREP_MAX) :] == tail
    q = env.log.questions[2]
    assert env.call_tool("q4", "grep", {"pattern": f"req={q.req} "}) == next(
        ln for ln in env.log.pages[q.about] if f"req={q.req} " in ln
    )
    assert env.call_tool("q4", "nope", {}).startswith("error")
    assert "5 of 30 pages" in env.progress()


def test_builtin_name_and_size_on_the_tiny_tokenizer():
    assert check_suite("logbook", {"subtasks": 200, "difficulty": 1}) == []
    suite = load_suite("logbook", subtasks=200, difficulty=1)
    from infra.engine.tiny_model import build_tokenizer

    tok = build_tokenizer()
    env = suite.start(suite.task(0), "")
    tokens = sum(len(tok(t.prompt)["input_ids"]) for t in env.turns)
    # 200 turns (>= 200 calls with the built-in harness) whose pages alone pass 100K tokens
    assert len(env.turns) == 200 and tokens >= 100_000
    page = len(tok(env.call_tool("q9", "read_page", {"n": 3}))["input_ids"])
    assert page >= 400  # a tool output is as large as a page
