"""The repo suite: specs, the workspace's tools, the evaluator on right and broken packages."""

from __future__ import annotations

import json
import os

import pytest

from tasks.env import sandbox
from tasks.env.repo import SPEC_DIR, RepoSuite, judge_spec, load_specs
from tasks.env.suite import Outcome

BROKEN_ROMAN = """\
def to_roman(n):
    return "I" * n


def from_roman(s):
    return len(s)
"""


def _start(tmp_path, name="roman", **kw):
    suite = RepoSuite(specs=[name], **kw)
    ws = tmp_path / "ws"
    ws.mkdir()
    return suite, suite.start(suite.task(0), str(ws)), ws


def _write_solution(env, rid="w"):
    for i, (path, content) in enumerate(env.spec.solution().items()):
        out = env.call_tool("build", "write_file", {"path": path, "content": content}, f"{rid}{i}")
        assert out.startswith("wrote "), out


def test_specs_are_complete():
    specs = load_specs()
    assert len(specs) >= 12
    for spec in specs.values():
        assert 1 <= len([f for f in spec.files if not f.endswith("__init__.py")]) <= 3
        assert len(spec.groups) >= 3 and all(g.n_tests >= 2 for g in spec.groups)
        assert spec.visible_tests() and spec.text.startswith(f"# {spec.name}")
        assert all(f.startswith(spec.package + "/") for f in spec.files)


def test_tasks_follow_the_seed_and_difficulty():
    suite = RepoSuite()
    assert [suite.task(s).task_id for s in range(6)] == [suite.task(s).task_id for s in range(6)]
    assert len({suite.task(s).task_id for s in range(40)}) > 5
    easy = RepoSuite(difficulty=0)
    assert {load_specs()[n].level for n in easy.specs} == {1}
    assert len(easy.specs) < len(suite.specs)
    task = suite.task(3)
    spec = load_specs()[task.data["spec"]]
    assert [s.subtask_id for s in task.subtasks] == [g.name for g in spec.groups]


def test_workspace_starts_with_the_spec_and_visible_tests_only(tmp_path):
    _, env, ws = _start(tmp_path)
    files = sorted(str(p.relative_to(ws)) for p in ws.rglob("*") if p.is_file())
    assert files == ["SPEC.md", "tests/test_examples.py"]
    assert "hidden" not in env.call_tool("build", "list_files", {})
    assert env.turns[0].prompt.startswith("# roman")


@pytest.mark.parametrize(
    "path",
    [
        "../x.py",
        "/etc/passwd",
        "a/../../x.py",
        "",
        "a/" * 150 + "x",
        str(SPEC_DIR / "roman/spec.md"),
    ],
)
def test_file_tools_stay_in_the_workspace(tmp_path, path):
    _, env, _ = _start(tmp_path)
    assert env.call_tool("build", "write_file", {"path": path, "content": "x"}).startswith("error")
    assert env.call_tool("build", "read_file", {"path": path}).startswith("error")
    assert not (tmp_path / "x.py").exists()


def test_file_tools_refuse_symlinks(tmp_path):
    _, env, ws = _start(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    os.symlink(secret, ws / "link.txt")  # as agent code run by run_tests could make
    os.symlink(tmp_path, ws / "linkdir")
    assert "symbolic links" in env.call_tool("build", "read_file", {"path": "link.txt"})
    out = env.call_tool("build", "write_file", {"path": "linkdir/x.py", "content": "x"})
    assert "symbolic links" in out and not (tmp_path / "x.py").exists()
    assert secret.read_text() == "do not read"


def test_file_tools_round_trip_and_limits(tmp_path):
    _, env, _ = _start(tmp_path)
    assert env.call_tool("build", "write_file", {"path": "roman/a.py", "content": "A = 1\n"}, "r1")
    assert env.call_tool("build", "read_file", {"path": "./roman/a.py"}) == "A = 1\n"
    assert "roman/a.py (6 bytes)" in env.call_tool("build", "list_files", {})
    big = env.call_tool("build", "write_file", {"path": "b.py", "content": "x" * 100_000})
    assert big.startswith("error: file larger")
    assert env.call_tool("build", "write_file", {"path": "c.py", "content": 3}).startswith("error")
    assert env.call_tool("build", "rm_rf", {}).startswith("error: no tool 'rm_rf'")
    assert env.writes == {"roman/a.py": (1, "r1")}


def test_run_tests_in_the_sandbox_cannot_see_hidden_tests(tmp_path):
    _, env, _ = _start(tmp_path)
    _write_solution(env)
    hidden = SPEC_DIR / "roman" / "hidden" / "test_errors.py"
    peek = f"def test_peek():\n    print(open({str(hidden)!r}).read())\n"
    env.call_tool("build", "write_file", {"path": "tests/test_peek.py", "content": peek})
    out = env.call_tool("build", "run_tests", {})
    # namespaces: the file is not there; the rlimits fallback: the audit hook refuses it
    assert "2 passed" in out and "1 failed" in out, out
    assert "FileNotFoundError" in out or "is hidden" in out, out
    assert "last test run: " in env.progress().lower() and "1 failed" in env.progress()


def test_evaluator_on_the_reference_solution(tmp_path):
    suite, env, _ = _start(tmp_path)
    _write_solution(env)
    rows = suite.evaluate(env, Outcome("finished"))
    assert [(r.subtask_id, r.score, r.status) for r in rows] == [
        ("to_roman", 1.0, "finished"),
        ("from_roman", 1.0, "finished"),
        ("errors", 1.0, "finished"),
    ]
    # each group was earned by the last write of the file its tests exercise
    assert {r.at_request_id for r in rows} == {"w1"} and {r.source for r in rows} == {"evaluator"}


def test_scores_are_earned_at_the_last_write_of_their_files(tmp_path):
    suite, env, _ = _start(tmp_path, "rpn")
    # meta.json: tokenize tests tokens.py + errors.py; evaluate calc.py; errors calc + errors
    assert list(env.spec.solution()) == [
        "rpn/__init__.py",
        "rpn/errors.py",
        "rpn/tokens.py",
        "rpn/calc.py",
    ]
    _write_solution(env)  # request ids w0 .. w3 in that order
    rows = suite.evaluate(env, Outcome("finished"))
    assert {r.subtask_id: r.at_request_id for r in rows} == {
        "tokenize": "w2",
        "evaluate": "w3",
        "errors": "w3",
    }
    assert {r.score for r in rows} == {1.0}


def test_evaluator_on_a_broken_solution_scores_pass_fractions(tmp_path):
    suite, env, _ = _start(tmp_path)
    _write_solution(env)
    env.call_tool(
        "build", "write_file", {"path": "roman/convert.py", "content": BROKEN_ROMAN}, "w9"
    )
    # tampering that must not count: conftest files that would drop every test
    drop = "def pytest_collection_modifyitems(items):\n    items.clear()\n"
    for path in ("conftest.py", "roman/conftest.py", "tests/conftest.py"):
        env.call_tool("build", "write_file", {"path": path, "content": drop})
    rows = suite.evaluate(env, Outcome("timeout", "ran out of time"))
    # by hand: to_roman 0/4; from_roman only the round trip (len("I" * n) == n) 1/4;
    # errors: to_roman(1.5) and to_roman("12") raise TypeError, but True does not -> 0/4
    assert [(r.score, r.status) for r in rows] == [
        (0.0, "timeout"),
        (0.25, "timeout"),
        (0.0, "timeout"),
    ]
    assert rows[1].reason.startswith("1/4 hidden tests pass; session timeout: ran out of time")
    assert rows[1].at_request_id == "w9"


def test_evaluator_without_a_package(tmp_path):
    suite, env, _ = _start(tmp_path)
    rows = suite.evaluate(env, Outcome("finished"))
    assert {(r.score, r.status) for r in rows} == {(0.0, "unfinished")}
    assert rows[0].reason == "no package roman/ in the workspace" and rows[0].at_request_id is None


def test_evaluator_survives_code_that_hangs(tmp_path):
    _, env, ws = _start(tmp_path)
    _write_solution(env)
    env.call_tool(
        "build", "write_file", {"path": "roman/__init__.py", "content": "while True:\n    pass\n"}
    )
    limits = sandbox.Limits(wall_s=3, cpu_s=30)
    verdict = judge_spec(env.spec, str(ws), limits=limits)
    assert verdict.error == "hidden tests stopped after 3s"
    assert verdict.passed == {"to_roman": 0, "from_roman": 0, "errors": 0}


def test_demonstration_transcript(tmp_path):
    suite = RepoSuite(specs=["stack"])
    (demo,) = suite.demonstrations(1, seed=0)
    msgs = demo["messages"]
    assert msgs[0]["role"] == "system" and msgs[1]["content"].startswith("# stack")
    calls = [m["tool_calls"][0]["function"] for m in msgs if m.get("tool_calls")]
    assert [c["name"] for c in calls] == ["write_file", "write_file", "run_tests"]
    written = {json.loads(c["arguments"])["path"] for c in calls[:2]}
    assert written == set(load_specs()["stack"].files)
    assert "2 passed" in msgs[-2]["content"] and msgs[-1] == {
        "role": "assistant",
        "content": "DONE",
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(load_specs()))
def test_every_reference_solution_passes_and_an_empty_module_fails(tmp_path, name):
    suite, env, ws = _start(tmp_path, name)
    _write_solution(env)
    assert "2 passed" in env.call_tool("build", "run_tests", {})
    assert [r.score for r in suite.evaluate(env, Outcome("finished"))] == [1.0] * len(
        env.spec.groups
    )
    for f in env.spec.files:  # every module emptied: nothing passes
        (ws / f).write_text("")
    assert [r.score for r in suite.evaluate(env, Outcome("finished"))] == [0.0] * len(
        env.spec.groups
    )
