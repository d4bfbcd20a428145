"""The tools suite: episodes from seeds, partial scores by hand, demonstrations that render."""

from __future__ import annotations

import json

import pytest

from tasks.env.suite import Outcome
from tasks.env.tools import (
    LEVELS,
    ToolsSuite,
    answer_score,
    calls_score,
    demonstrations,
    make_episode,
)


def test_episodes_follow_the_seed():
    assert make_episode(4, 5, 2) == make_episode(4, 5, 2)
    assert make_episode(4, 5, 2) != make_episode(5, 5, 2)
    s = ToolsSuite(subtasks=4, difficulty=1)
    assert s.task(9) == s.task(9) and len(s.task(9).subtasks) == 4


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_difficulty_levels(level):
    lv = LEVELS[level]
    for seed in range(20):
        boxes, qs = make_episode(seed, 6, level)
        assert len(boxes) == lv.boxes
        assert all(len(str(b["code"])) == lv.digits for b in boxes.values())
        for q in qs:
            assert all(tool in lv.tools for tool, _ in q.calls)
            tool, box = q.calls[-1]
            assert q.answer == str(boxes[box][tool.removeprefix("get_")])
            if len(q.calls) == 2:  # a chain: the second box is the first one's next
                assert q.calls[0] == ("get_next", q.text.split(" the ")[-1].split()[0])
                assert box == boxes[q.calls[0][1]]["next"]
    kinds = {len(q.calls) for s in range(20) for q in make_episode(s, 6, level)[1]}
    assert kinds == ({1, 2} if lv.chain else {1})


def test_answer_score_by_hand():
    assert answer_score("47", "47") == 1.0
    assert answer_score("It is 47.", "47") == 1.0
    assert answer_score("48", "47") == 0.5
    assert answer_score("407", "47") == 1 / 3  # 4 matches; 0 vs 7 no; 3 positions
    assert answer_score("7", "47") == 0.0
    assert answer_score("no idea", "47") == 0.0


def test_calls_score_by_hand():
    need = (("get_code", "red"),)
    assert calls_score([("get_code", "red")], need) == 1.0
    assert calls_score([("get_code", "blue")], need) == 0.5
    assert calls_score([("get_size", "red")], need) == 0.0
    assert calls_score([], need) == 0.0
    chain = (("get_next", "red"), ("get_code", "green"))
    assert calls_score([("get_next", "red"), ("get_code", "blue")], chain) == 0.75


def _first(suite, seed=0):
    task = suite.task(seed)
    env = suite.start(task, "")
    q = env.questions[0]
    tool, box = q.calls[0]
    return env, q, tool, box


def test_attempts_are_scored_and_the_best_one_kept():
    suite = ToolsSuite(subtasks=2, difficulty=0)
    env, q, tool, box = _first(suite)
    wrong = next(c for c in env.boxes if c != box)
    assert env.call_tool(q.subtask_id, tool, {"box": wrong}, "c0") == str(env.boxes[wrong]["code"])
    near = str(int(q.answer[0]) % 9 + 1) + q.answer[1:]  # first digit wrong, second right
    assert env.submit(q.subtask_id, near, "a0") == 0.5 * 0.5 + 0.5 * 0.5
    env.call_tool(q.subtask_id, tool, {"box": box}, "c1")
    assert env.submit(q.subtask_id, q.answer, "a1") == 1.0
    env.submit(q.subtask_id, "nothing", "a2")  # a worse retry does not replace the best
    rows = suite.evaluate(env, Outcome("finished"))
    assert (rows[0].score, rows[0].at_request_id, rows[0].status) == (1.0, "a1", "finished")
    assert (rows[1].score, rows[1].status) == (0.0, "unfinished")


def test_credit_for_calls_alone_lands_on_the_call():
    suite = ToolsSuite(subtasks=1, difficulty=0)
    env, q, tool, box = _first(suite, seed=3)
    env.call_tool(q.subtask_id, tool, {"box": box.upper()}, "c7")  # colour case is ignored
    assert env.submit(q.subtask_id, "I do not know", "a7") == 0.5
    rows = suite.evaluate(env, Outcome("timeout", "slow"))
    assert (rows[0].score, rows[0].at_request_id) == (0.5, "c7")


def test_tool_errors():
    suite = ToolsSuite(subtasks=1, difficulty=0)
    env, q, _, _ = _first(suite)
    assert env.call_tool(q.subtask_id, "get_size", {"box": "red"}) == "error: no tool 'get_size'"
    assert env.call_tool(q.subtask_id, "get_code", {"box": "mauve"}) == "error: no mauve box"
    assert env.call_tool(q.subtask_id, "get_code", {}) == "error: no unnamed box"


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_demonstrations_are_correct_transcripts(level):
    demos = demonstrations(3, seed=11, difficulty=level, subtasks=3)
    assert demos == demonstrations(3, seed=11, difficulty=level, subtasks=3)
    suite = ToolsSuite(subtasks=3, difficulty=level)
    for k, demo in enumerate(demos):
        env = suite.start(suite.task(11 + k), "")
        msgs = demo["messages"]
        assert msgs[0] == {"role": "system", "content": env.system_prompt}
        assert demo["tools"] == env.tools
        turns, turn = iter(env.turns), None
        for m in msgs[1:]:  # replay the transcript into a fresh environment
            if m["role"] == "user":
                turn = next(turns)
                assert m["content"] == turn.prompt
            elif m["role"] == "assistant" and m.get("tool_calls"):
                (tc,) = m["tool_calls"]
                result = env.call_tool(
                    turn.turn_id, tc["function"]["name"], json.loads(tc["function"]["arguments"])
                )
            elif m["role"] == "tool":
                assert m["content"] == result
            else:
                assert env.submit(turn.turn_id, m["content"]) == 1.0
        assert [r.score for r in suite.evaluate(env, Outcome("finished"))] == [1.0] * 3


def test_demonstrations_render_to_tool_calls_the_gateway_parses():
    from infra.engine.tiny_model import build_tokenizer
    from infra.gateway.chat import parse_output

    tok = build_tokenizer()
    demo = demonstrations(1, seed=0, difficulty=3, subtasks=4)[0]
    text = tok.apply_chat_template(demo["messages"], tools=demo["tools"], tokenize=False)
    calls = [m["tool_calls"][0] for m in demo["messages"] if m.get("tool_calls")]
    blocks = text.split("<|im_start|>assistant\n")[1:]
    replies = [b.split("<|im_end|>")[0] for b in blocks]
    parsed = [parse_output(r) for r in replies]
    got = [
        (c[0]["function"]["name"], json.loads(c[0]["function"]["arguments"]))
        for _, c in parsed
        if c
    ]
    want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert got == want and len(want) >= 4
    answers = [content for content, c in parsed if not c]
    assert answers == [
        m["content"]
        for m in demo["messages"]
        if m["role"] == "assistant" and not m.get("tool_calls")
    ]
    # short enough for a tiny model: after the system turn (tool schemas, a shared prefix),
    # four questions with chains take a few hundred tokens, a tool call ~23
    system = tok.apply_chat_template(demo["messages"][:1], tools=demo["tools"], tokenize=False)
    assert len(tok(text)["input_ids"]) - len(tok(system)["input_ids"]) < 400
