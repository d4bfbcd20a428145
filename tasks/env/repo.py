"""The ``repo`` suite: build a small Python package from a natural-language spec.

In the spirit of NL2RepoBench (the seed's evaluation), made small: each spec in
``tasks/env/repo_specs/<name>/`` is a package of one to three modules described in prose
(``spec.md``), a few visible example tests, hidden pytest tests grouped by sub-task
(``hidden/test_<group>.py``), a reference solution (``solution/``, never shown) and
``meta.json`` (package name, level, files, groups). A sub-task's score is the fraction of
its group's hidden tests that pass.

The agent works in a private workspace (``SPEC.md`` and ``tests/test_examples.py`` to start
with) through four tools: ``write_file``, ``read_file``, ``list_files`` and ``run_tests``
(the workspace's tests, in the sandbox). Its turn ends with a reply without tool calls.

Evaluation (after the session, whatever its status): the ``.py`` files of the package
directory, and nothing else (no ``conftest.py``, ini files or other top-level modules that
could change how pytest runs), are copied with the hidden tests into a fresh directory and
run once under the sandbox (tasks/env/sandbox.py) with pytest's JUnit report. Per-test
timeouts come from pytest-timeout when it is installed; the sandbox's wall clock bounds the
whole run. Hidden tests never enter the workspace and the sandbox does not show the gyre
source; the harness's file tools refuse paths outside the workspace and symlinks. What this
does not stop: package code that, once imported by the tests, tampers with pytest itself
(it runs in the same process); a reward-hacking policy would have to learn that.

``difficulty``: 0 = level-1 specs only (functions in one module); 1 (default) = every spec.

Pure module apart from the sandboxed subprocesses: no prefect, no distributed.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from tasks.env import sandbox
from tasks.env.repo_eval import EVAL_LIMITS, PER_TEST_TIMEOUT_S, Judgement, judge, run_pytest
from tasks.env.suite import Outcome, SubtaskScore, SubtaskSpec, SuiteError, Task, Turn
from tasks.env.workspace import (
    ToolError,
    list_files,
    read_file,
    rel_path,
    write_file,
)

SPEC_DIR = Path(__file__).with_name("repo_specs")

MAX_TEST_OUTPUT = 2_000
MAX_TOOL_ROUNDS = 24
TEST_LIMITS = sandbox.Limits(wall_s=30, cpu_s=20)

SYSTEM_PROMPT = (
    "You are a software engineer. Build the Python package the user describes, file by file, "
    "with the tools: write_file, read_file, list_files and run_tests (runs the tests in "
    "tests/). When the package is complete, reply DONE without calling a tool."
)


def _tool(name: str, description: str, props: dict[str, str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": "string", "description": v} for k, v in props.items()},
                "required": list(props),
            },
        },
    }


TOOLS = [
    _tool(
        "write_file",
        "Write a text file in the workspace.",
        {"path": "relative path", "content": "the whole file"},
    ),
    _tool("read_file", "Read a text file of the workspace.", {"path": "relative path"}),
    _tool("list_files", "List the workspace's files.", {}),
    _tool("run_tests", "Run pytest on tests/ and show the result.", {}),
]


# -- specs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    name: str
    weight: float
    files: tuple[str, ...]  # package files its tests exercise (where a score was earned)
    n_tests: int


@dataclass(frozen=True)
class RepoSpec:
    name: str
    package: str
    level: int
    text: str
    files: tuple[str, ...]
    groups: tuple[Group, ...]
    root: Path

    def hidden_test(self, group: str) -> Path:
        return self.root / "hidden" / f"test_{group}.py"

    def visible_tests(self) -> list[Path]:
        return sorted((self.root / "visible").glob("test_*.py"))

    def solution(self) -> dict[str, str]:
        """The reference solution: workspace path -> content."""
        sol = self.root / "solution"
        return {f: (sol / f).read_text() for f in self.files}


def count_tests(path: Path) -> int:
    """Test functions (and methods of ``Test*`` classes) in a test module, by its syntax."""
    tree = ast.parse(path.read_text())
    n = 0
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            n += 1
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            n += sum(
                isinstance(m, ast.FunctionDef) and m.name.startswith("test") for m in node.body
            )
    return n


def _load_spec(root: Path) -> RepoSpec:
    meta = json.loads((root / "meta.json").read_text())
    groups = tuple(
        Group(
            name,
            float(g.get("weight", 1.0)),
            tuple(g.get("files", meta["files"])),
            count_tests(root / "hidden" / f"test_{name}.py"),
        )
        for name, g in meta["groups"].items()
    )
    return RepoSpec(
        root.name,
        meta["package"],
        int(meta["level"]),
        (root / "spec.md").read_text(),
        tuple(meta["files"]),
        groups,
        root,
    )


@cache
def load_specs(spec_dir: str = str(SPEC_DIR)) -> dict[str, RepoSpec]:
    """Every spec under ``spec_dir``, by name (sorted), checked for completeness."""
    specs, problems = {}, []
    for root in sorted(Path(spec_dir).iterdir()):
        if not (root / "meta.json").is_file():
            continue
        try:
            spec = _load_spec(root)
        except (OSError, ValueError, KeyError, SyntaxError) as exc:
            problems.append(f"spec {root.name}: {type(exc).__name__}: {exc}")
            continue
        for g in spec.groups:
            if g.n_tests == 0:
                problems.append(f"spec {root.name}: group {g.name} has no tests")
        missing = [f for f in spec.files if not (root / "solution" / f).is_file()]
        if missing:
            problems.append(f"spec {root.name}: solution lacks {missing}")
        specs[spec.name] = spec
    if problems:
        raise SuiteError(problems)
    return specs


# -- environment -------------------------------------------------------------------------------


@dataclass
class RepoEnv:
    """One session's workspace and what the agent did in it."""

    task: Task
    spec: RepoSpec
    workdir: str
    isolation: str = "auto"
    system_prompt: str = SYSTEM_PROMPT
    tools: list[dict[str, Any]] = field(default_factory=lambda: list(TOOLS))
    max_tool_rounds: int = MAX_TOOL_ROUNDS
    writes: dict[str, tuple[int, str | None]] = field(default_factory=dict)  # path -> (n, rid)
    n_calls: int = 0
    last_tests: str = "not run"
    final_request_id: str | None = None

    @property
    def turns(self) -> list[Turn]:
        prompt = (
            f"{self.spec.text.strip()}\n\nThe workspace has SPEC.md and the example tests in "
            "tests/. Write the package, run the tests, then reply DONE."
        )
        return [Turn("build", prompt)]

    def call_tool(
        self, turn_id: str, name: str, arguments: dict[str, Any], request_id: str | None = None
    ) -> str:
        self.n_calls += 1
        try:
            if name == "write_file":
                out = write_file(self.workdir, arguments.get("path"), arguments.get("content"))
                rel = rel_path(self.workdir, arguments.get("path"))
                self.writes[rel] = (self.n_calls, request_id)
                return out
            if name == "read_file":
                return read_file(self.workdir, arguments.get("path"))
            if name == "list_files":
                return list_files(self.workdir)
            if name == "run_tests":
                return self.run_tests()
            return f"error: no tool {name!r}; use {', '.join(t['function']['name'] for t in TOOLS)}"
        except ToolError as exc:
            return str(exc)

    def run_tests(self) -> str:
        res = run_pytest(
            self.workdir,
            ["tests"],
            limits=TEST_LIMITS,
            isolation=self.isolation,
            hide=(str(SPEC_DIR),),
        )
        text = (res.stdout + res.stderr).strip()
        if res.timed_out:
            text += f"\n[tests stopped after {TEST_LIMITS.wall_s:.0f}s]"
        lines = [ln for ln in text.splitlines() if ln.strip()]
        self.last_tests = lines[-1][:200] if lines else f"exit status {res.returncode}"
        if len(text) > MAX_TEST_OUTPUT:
            text = "[...]\n" + text[-MAX_TEST_OUTPUT:]
        return text or f"(no output, exit status {res.returncode})"

    def submit(self, turn_id: str, text: str, request_id: str | None = None) -> None:
        self.final_request_id = request_id
        return None  # judged only by the hidden tests, after the session

    def progress(self) -> str:
        files = ", ".join(sorted(self.writes)) or "none"
        return f"files written: {files}. Last test run: {self.last_tests}."

    def close(self) -> None:
        pass


def judge_spec(
    spec: RepoSpec,
    workdir: str,
    isolation: str = "auto",
    limits: sandbox.Limits = EVAL_LIMITS,
    per_test_s: float = PER_TEST_TIMEOUT_S,
) -> Judgement:
    """The spec's hidden tests against the workspace's package (``repo_eval.judge``)."""
    hidden = {g.name: spec.hidden_test(g.name) for g in spec.groups}
    return judge(
        spec.package,
        hidden,
        workdir,
        isolation=isolation,
        limits=limits,
        per_test_s=per_test_s,
        hide=(str(SPEC_DIR),),
    )


class RepoSuite:
    """Specs chosen by seed; the workspace judged by hidden tests after each session."""

    name = "repo"

    def __init__(
        self,
        difficulty: int = 1,
        isolation: str = "auto",
        specs: list[str] | None = None,
        eval_limits: sandbox.Limits = EVAL_LIMITS,
    ):
        problems = []
        if importlib.util.find_spec("pytest") is None:
            problems.append("the repo suite runs pytest: pip install pytest")
        all_specs = load_specs()
        names = specs or [n for n, s in all_specs.items() if difficulty >= 1 or s.level <= 1]
        unknown = [n for n in names if n not in all_specs]
        if unknown:
            problems.append(f"unknown repo specs {unknown}; known: {sorted(all_specs)}")
        if problems:
            raise SuiteError(problems)
        self.specs = {n: all_specs[n] for n in sorted(names)}
        self.difficulty, self.isolation, self.eval_limits = difficulty, isolation, eval_limits

    def task(self, seed: int) -> Task:
        name = random.Random(seed).choice(sorted(self.specs))
        spec = self.specs[name]
        return Task(
            f"repo-{name}",
            seed,
            tuple(SubtaskSpec(g.name, g.weight, f"{g.n_tests} hidden tests") for g in spec.groups),
            {"spec": name, "package": spec.package, "files": list(spec.files)},
        )

    def start(self, task: Task, workdir: str) -> RepoEnv:
        spec = self.specs[task.data["spec"]]
        Path(workdir, "SPEC.md").write_text(spec.text)
        tests = Path(workdir, "tests")
        tests.mkdir(exist_ok=True)
        for t in spec.visible_tests():
            shutil.copyfile(t, tests / t.name)
        return RepoEnv(task, spec, workdir, self.isolation)

    def evaluate(self, env: RepoEnv, outcome: Outcome) -> list[SubtaskScore]:
        verdict = judge_spec(env.spec, env.workdir, self.isolation, self.eval_limits)
        last_write = max(env.writes.values(), default=(0, None), key=lambda w: w[0])[1]
        scores = []
        for g in env.spec.groups:
            n = min(verdict.passed.get(g.name, 0), g.n_tests)
            writes = [env.writes[f] for f in g.files if f in env.writes]
            at = max(writes, key=lambda w: w[0])[1] if writes else last_write
            reason = verdict.error or f"{n}/{g.n_tests} hidden tests pass"
            if n == g.n_tests:
                status, reason = "finished", ""
            elif verdict.error and "stopped" in verdict.error:
                status = "timeout" if outcome.status == "finished" else outcome.status
            else:
                status = "unfinished" if outcome.status == "finished" else outcome.status
            if outcome.status != "finished" and outcome.reason:
                reason = f"{reason}; session {outcome.status}: {outcome.reason}"[:500]
            scores.append(
                SubtaskScore(g.name, n / g.n_tests, g.weight, at, status, reason, "evaluator")
            )
        return scores

    def demonstrations(self, n: int, seed: int) -> list[dict[str, Any]]:
        """``n`` correct transcripts (tasks ``seed``, ``seed + 1``, ...): one ``write_file``
        per file of the reference solution, ``run_tests``, then DONE; tool results are the
        real ones (the visible tests run in the sandbox)."""
        out = []
        for k in range(n):
            task = self.task(seed + k)
            with tempfile.TemporaryDirectory(prefix="gyre-repo-demo-") as tmp:
                env = self.start(task, tmp)
                msgs: list[dict[str, Any]] = [
                    {"role": "system", "content": env.system_prompt},
                    {"role": "user", "content": env.turns[0].prompt},
                ]
                calls = [
                    ("write_file", {"path": p, "content": c})
                    for p, c in env.spec.solution().items()
                ]
                for j, (name, args) in enumerate([*calls, ("run_tests", {})]):
                    cid = f"call_{j}"
                    msgs.append(
                        {
                            "role": "assistant",
                            "content": "",
                            "tool_calls": [
                                {
                                    "id": cid,
                                    "type": "function",
                                    "function": {"name": name, "arguments": json.dumps(args)},
                                }
                            ],
                        }
                    )
                    result = env.call_tool("build", name, args)
                    msgs.append({"role": "tool", "tool_call_id": cid, "content": result})
                msgs.append({"role": "assistant", "content": "DONE"})
            out.append({"messages": msgs, "tools": list(TOOLS)})
        return out
