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
import errno
import importlib.util
import json
import os
import random
import shutil
import stat
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from tasks.env import sandbox
from tasks.env.suite import Outcome, SubtaskScore, SubtaskSpec, SuiteError, Task, Turn

SPEC_DIR = Path(__file__).with_name("repo_specs")

MAX_FILE_BYTES = 64_000
MAX_READ_CHARS = 6_000
MAX_TEST_OUTPUT = 2_000
MAX_FILES = 200
MAX_PATH = 200
MAX_TOOL_ROUNDS = 24
TEST_LIMITS = sandbox.Limits(wall_s=30, cpu_s=20)
EVAL_LIMITS = sandbox.Limits(wall_s=90, cpu_s=60)
PER_TEST_TIMEOUT_S = 10

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


# -- the workspace's file tools ------------------------------------------------------------------


class ToolError(Exception):
    """A tool call the workspace refuses; its message is the tool result the agent sees."""


def _rel_path(workdir: str, path: Any) -> str:
    """A safe relative path inside ``workdir`` (no absolute paths, ``..``, dot-dirs or links)."""
    if not isinstance(path, str) or not path.strip():
        raise ToolError("error: path must be a non-empty string")
    p = path.strip().replace("\\", "/")
    if len(p) > MAX_PATH or "\0" in p:
        raise ToolError("error: path too long or invalid")
    if p.startswith("/"):
        raise ToolError("error: use a path relative to the workspace")
    parts = [x for x in p.split("/") if x not in ("", ".")]
    if not parts or any(x == ".." for x in parts):
        raise ToolError("error: the path must stay inside the workspace")
    full = os.path.join(workdir, *parts)
    # every existing component must be a real directory/file inside the workspace
    cur = workdir
    for x in parts:
        cur = os.path.join(cur, x)
        if os.path.islink(cur):
            raise ToolError(f"error: {'/'.join(parts)}: symbolic links are not followed")
    real_ws = os.path.realpath(workdir)
    if not os.path.realpath(full).startswith(real_ws + os.sep):
        raise ToolError("error: the path must stay inside the workspace")
    return "/".join(parts)


def write_file(workdir: str, path: Any, content: Any) -> str:
    rel = _rel_path(workdir, path)
    if not isinstance(content, str):
        raise ToolError("error: content must be a string")
    data = content.encode()
    if len(data) > MAX_FILE_BYTES:
        raise ToolError(f"error: file larger than {MAX_FILE_BYTES} bytes")
    full = os.path.join(workdir, rel)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    _rel_path(workdir, rel)  # again: a directory made above could not have been a link
    try:
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise ToolError(
            f"error: cannot write {rel}: {os.strerror(exc.errno or errno.EIO)}"
        ) from exc
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return f"wrote {rel} ({len(data)} bytes)"


def read_file(workdir: str, path: Any) -> str:
    rel = _rel_path(workdir, path)
    full = os.path.join(workdir, rel)
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ToolError(f"error: cannot read {rel}: {os.strerror(exc.errno or errno.EIO)}") from exc
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ToolError(f"error: {rel} is not a file")
        data = f.read(MAX_READ_CHARS * 4 + 1)
    text = data.decode("utf-8", "replace")
    if len(text) > MAX_READ_CHARS:
        text = text[:MAX_READ_CHARS] + "\n[... truncated ...]"
    return text


def list_files(workdir: str) -> str:
    out = []
    for dirpath, dirnames, filenames in os.walk(workdir):  # never follows links
        dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", ".pytest_cache"))
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, workdir)
            out.append(f"{rel} ({os.lstat(full).st_size} bytes)")
            if len(out) >= MAX_FILES:
                return "\n".join([*out, "[... more files ...]"])
    return "\n".join(out) or "(no files)"


def _pytest_args(
    paths: list[str], report: str | None, per_test_s: float = PER_TEST_TIMEOUT_S
) -> list[str]:
    args = ["-q", "-p", "no:cacheprovider", "--rootdir", "."]
    if _has_pytest_timeout():
        args += ["-p", "pytest_timeout", f"--timeout={per_test_s}"]
    if report:
        args += ["--junitxml", report, "-o", "junit_family=xunit1"]
    return [*args, *paths]


_RUN_PYTEST = (
    "import os, sys\n"
    "sys.path.insert(0, os.getcwd())\n"
    "import pytest\n"
    "sys.exit(pytest.main(sys.argv[1:]))\n"
)
_PYTEST_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


@cache
def _has_pytest_timeout() -> bool:
    return importlib.util.find_spec("pytest_timeout") is not None


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
                rel = _rel_path(self.workdir, arguments.get("path"))
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
        res = sandbox.run_python(
            _RUN_PYTEST,
            _pytest_args(["tests"], None),
            workspace=self.workdir,
            limits=TEST_LIMITS,
            isolation=self.isolation,
            env=_PYTEST_ENV,
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


# -- evaluation --------------------------------------------------------------------------------


def _copy_package(workdir: str, package: str, dest: str) -> list[str]:
    """Copy the package's ``.py`` files (regular files, no links, no conftest) to ``dest``."""
    copied = []
    src_root = os.path.join(workdir, package)
    if not os.path.isdir(src_root) or os.path.islink(src_root):
        return copied
    for dirpath, dirnames, filenames in os.walk(src_root):
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        for name in filenames:
            src = os.path.join(dirpath, name)
            if not name.endswith(".py") or name == "conftest.py" or len(copied) >= MAX_FILES:
                continue
            st = os.lstat(src)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE_BYTES:
                continue
            rel = os.path.relpath(src, workdir)
            dst = os.path.join(dest, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f, open(dst, "wb") as g:
                g.write(f.read(MAX_FILE_BYTES))
            copied.append(rel)
    return sorted(copied)


def parse_junit(xml_text: str, groups: dict[str, str]) -> dict[str, int]:
    """Passed tests per group from a JUnit report; ``groups``: test module name -> group."""
    passed = dict.fromkeys(groups.values(), 0)
    root = ET.fromstring(xml_text)
    for case in root.iter("testcase"):
        module = (case.get("classname") or "").split(".")
        group = next((groups[m] for m in module if m in groups), None)
        if group is None:
            continue
        if not any(child.tag in ("failure", "error", "skipped") for child in case):
            passed[group] += 1
    return passed


@dataclass(frozen=True)
class Judgement:
    passed: dict[str, int]
    error: str = ""  # why there is no report (then every group counts 0)
    output: str = ""


def judge(
    spec: RepoSpec,
    workdir: str,
    isolation: str = "auto",
    limits: sandbox.Limits = EVAL_LIMITS,
    per_test_s: float = PER_TEST_TIMEOUT_S,
) -> Judgement:
    """Run the hidden tests against the workspace's package; passed tests per group."""
    with tempfile.TemporaryDirectory(prefix="gyre-repo-eval-") as tmp:
        copied = _copy_package(workdir, spec.package, tmp)
        if not copied:
            return Judgement(
                {g.name: 0 for g in spec.groups}, f"no package {spec.package}/ in the workspace"
            )
        tests = os.path.join(tmp, "hidden_tests")
        os.makedirs(tests)
        modules = {}
        for g in spec.groups:
            shutil.copyfile(spec.hidden_test(g.name), os.path.join(tests, f"test_{g.name}.py"))
            modules[f"test_{g.name}"] = g.name
        res = sandbox.run_python(
            _RUN_PYTEST,
            _pytest_args(["hidden_tests"], "report.xml", per_test_s),
            workspace=tmp,
            limits=limits,
            isolation=isolation,
            env=_PYTEST_ENV,
            hide=(str(SPEC_DIR),),
        )
        output = (res.stdout + res.stderr)[-2000:]
        report = os.path.join(tmp, "report.xml")
        if res.timed_out:
            return Judgement(
                dict.fromkeys(modules.values(), 0),
                f"hidden tests stopped after {limits.wall_s:.0f}s",
                output,
            )
        try:
            fd = os.open(report, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                xml_text = f.read(4_000_000).decode("utf-8", "replace")
            passed = parse_junit(xml_text, modules)
        except (OSError, ET.ParseError) as exc:
            return Judgement(
                dict.fromkeys(modules.values(), 0),
                f"no test report ({type(exc).__name__}; exit status {res.returncode})",
                output,
            )
        return Judgement(passed, "", output)


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
        verdict = judge(env.spec, env.workdir, self.isolation, self.eval_limits)
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
