"""The task-suite contract: loading by dotted path, validation errors (all at once), scores."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.config import ConfigError, load_config
from tasks.env.config import RolloutConfig
from tasks.env.suite import (
    Outcome,
    SubtaskScore,
    SubtaskSpec,
    SuiteError,
    Task,
    check_harness,
    check_suite,
    close_scores,
    load_suite,
    parse_harness,
)

FAKE = "tests.tasks.env.fake_suites"


def test_builtin_names_and_dotted_paths_load():
    for name in ("arith", "tools", "repo"):
        suite = load_suite(name)
        assert suite.name == name
        assert suite.task(3) == suite.task(3)  # deterministic from the seed
    user = load_suite(f"{FAKE}:EchoSuite", subtasks=3, difficulty=2, isolation="auto")
    assert user.name == "echo" and len(user.task(0).subtasks) == 3  # only named options passed
    assert load_suite(f"{FAKE}.EchoSuite").name == "echo"  # module.attr works too


@pytest.mark.parametrize(
    ("path", "expect"),
    [
        ("nonexistent_pkg.suites:MySuite", "module 'nonexistent_pkg.suites' not found"),
        (f"{FAKE}:Missing", "has no attribute 'Missing'; it defines: "),
        ("justaword", "not a dotted path"),
        (f"{FAKE}:NoMethods", "the suite has no method start()"),
        (f"{FAKE}:BadInit", "building the suite failed: ValueError: difficulty 1"),
        ("tests.tasks.env.broken_module:X", "importing 'tests.tasks.env.broken_module' failed"),
        (f"{FAKE}:BadTask", "task(seed) returned dict, not tasks.env.suite.Task"),
        (f"{FAKE}:BadEnv", "start() returned an env without 'system_prompt'"),
    ],
)
def test_bad_suites_are_reported_with_the_setting_and_a_fix(path, expect):
    problems = check_suite(path, {"difficulty": 1, "subtasks": 2})
    assert problems, path
    assert all(p.startswith(f"rollout.suite={path!r}: ") for p in problems)
    assert any(expect in p for p in problems), problems


def test_missing_methods_are_all_listed():
    problems = check_suite(f"{FAKE}:NoMethods", {})
    assert sum("has no method" in p for p in problems) == 2  # start() and evaluate()


def test_harness_specs():
    assert check_harness("builtin") == []
    assert check_harness(f"{FAKE}:echo_harness") == []
    assert check_harness("cmd:python -c pass") == []
    # the command runs in its workdir: a relative script path is made absolute up front
    kind, argv, _ = parse_harness("cmd:python tests/tasks/env/echo_agent.py --flag")
    assert kind == "cmd" and argv[0] == "python" and argv[2] == "--flag"
    assert argv[1] == str(Path("tests/tasks/env/echo_agent.py").resolve())
    bad = {
        "cmd:/no/such/agent --x": "'/no/such/agent' is not an executable",
        "cmd:": "empty command",
        "cmd:python 'unclosed": "cannot split",
        f"{FAKE}:NOT_CALLABLE": "int is not callable",
        "nope.mod:run": "or use 'builtin' or 'cmd:COMMAND'",
    }
    for spec, expect in bad.items():
        problems = check_harness(spec)
        assert problems and expect in problems[0], (spec, problems)


def test_run_config_reports_every_problem_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(
            preset="tiny",
            overrides=[
                "rollout.suite=nonexistent_pkg:S",
                "rollout.harness=cmd:/no/such/agent",
                "rollout.group_size=0",
            ],
        )
    text = str(err.value)
    assert "rollout.suite='nonexistent_pkg:S'" in text and "not found" in text
    assert "rollout.harness='cmd:/no/such/agent'" in text and "not an executable" in text
    assert "rollout.group_size=0" in text


def test_suite_options_reach_the_check():
    # difficulty 7 is not a level of the tools suite: caught when the config is validated
    with pytest.raises(ValueError, match="the tools suite has levels"):
        RolloutConfig(suite="tools", difficulty=7)
    assert RolloutConfig(suite="tools", difficulty=3).suite == "tools"
    assert RolloutConfig().suite == "arith"  # the default run is unchanged


def test_close_scores_fills_unreached_subtasks():
    task = Task("t", 0, (SubtaskSpec("a", 2.0), SubtaskSpec("b", 1.0)))
    earned = {"a": SubtaskScore("a", 0.5, 2.0, "req-1")}
    rows = close_scores(task, earned, Outcome("timeout", "slow"))
    assert rows[0] is earned["a"]
    assert rows[1] == SubtaskScore("b", 0.0, 1.0, None, "timeout", "slow")
    done = close_scores(task, {}, Outcome("finished"))
    assert [r.status for r in done] == ["unfinished", "unfinished"]
    assert done[0].reason == "session ended before this sub-task"


def test_score_bounds_and_status_are_checked():
    with pytest.raises(ValueError):
        SubtaskScore("a", 1.5)
    with pytest.raises(ValueError):
        SubtaskScore("a", 0.5, status="done")
    row = SubtaskScore("a", 0.25, 2.0, "r", "finished", "", "evaluator").row()
    assert row == {
        "subtask_id": "a",
        "score": 0.25,
        "weight": 2.0,
        "at_request_id": "r",
        "source": "evaluator",
        "status": "finished",
        "reason": "",
    }


def test_load_suite_raises_suite_error():
    with pytest.raises(SuiteError) as err:
        load_suite(f"{FAKE}:NoMethods")
    assert len(err.value.problems) == 2
