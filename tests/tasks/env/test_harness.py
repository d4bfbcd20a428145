"""The built-in harness's pure parts: context compaction and a subprocess harness's report."""

from __future__ import annotations

from tasks.env.harness import compact, parse_arguments, replay
from tasks.env.tools import ToolsSuite

SYSTEM = {"role": "system", "content": "S"}


class _Env:
    def progress(self):
        return "2 of 3 questions answered."


def _exchange(i):
    call = {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"c{i}", "content": f"r{i}a"},
        {"role": "tool", "tool_call_id": f"c{i}", "content": f"r{i}b"},
    ]


def test_compact_keeps_system_summary_prompt_and_whole_last_exchanges():
    old = [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0"}]
    prompt = {"role": "user", "content": "q1"}
    msgs = [SYSTEM, *old, prompt, *_exchange(1), *_exchange(2), *_exchange(3)]
    out = compact(msgs, prompt, _Env(), "summarize")
    summary = {"role": "user", "content": "Summary so far: 2 of 3 questions answered."}
    assert out == [SYSTEM, summary, prompt, *_exchange(2), *_exchange(3)]
    assert compact(msgs, prompt, _Env(), "truncate") == [
        SYSTEM,
        prompt,
        *_exchange(2),
        *_exchange(3),
    ]
    # at the start of a turn there is nothing of the turn to keep but its prompt
    assert compact([SYSTEM, *old, prompt], prompt, _Env(), "truncate") == [SYSTEM, prompt]
    # the new context is not an extension of the old one: the next call starts a branch
    assert out[: len(msgs)] != msgs[: len(out)]


def test_compact_finds_the_prompt_by_identity():
    prompt = {"role": "user", "content": "same"}
    twin = {"role": "user", "content": "same"}  # an earlier turn with the same text
    msgs = [SYSTEM, twin, {"role": "assistant", "content": "x"}, prompt, *_exchange(1)]
    assert compact(msgs, prompt, _Env(), "truncate") == [SYSTEM, prompt, *_exchange(1)]


def test_parse_arguments():
    assert parse_arguments('{"box": "red"}') == {"box": "red"}
    assert parse_arguments("not json") == {} and parse_arguments("[1]") == {}
    assert parse_arguments(None) == {}


def test_replay_feeds_calls_then_answers():
    suite = ToolsSuite(subtasks=2, difficulty=0)
    env = suite.start(suite.task(1), "")
    q0, q1 = env.questions
    (tool, box) = q0.calls[0]
    report = {
        "tool_calls": {
            q0.subtask_id: [{"name": tool, "arguments": f'{{"box": "{box}"}}', "request_id": "r1"}]
        },
        "answers": {
            q0.subtask_id: {"text": q0.answer, "request_id": "r2"},
            q1.subtask_id: "no idea",
            "not-a-turn": "ignored",
        },
    }
    replay(env, report)
    assert env.results[q0.subtask_id].score == 1.0
    assert env.results[q0.subtask_id].at_request_id == "r2"
    assert env.results[q1.subtask_id].score == 0.0
