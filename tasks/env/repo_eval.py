"""The repo suite's judge: pytest in the sandbox, hidden tests beside a copy of the package.

``run_pytest`` runs pytest on paths of a workspace under tasks/env/sandbox.py (plugins not
autoloaded, no cache, per-test timeouts from pytest-timeout when installed). ``judge`` copies
only the ``.py`` files of the package directory (regular files, no links, no ``conftest.py``)
into a fresh directory beside the hidden tests, runs them once with a JUnit report, and
counts the passed tests of each group. Anything that keeps the report from being written (a
crash, the wall clock) counts every group 0, with the reason.

Pure module apart from the sandboxed subprocess: no prefect, no distributed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tasks.env import sandbox
from tasks.env.workspace import MAX_FILE_BYTES, MAX_FILES

EVAL_LIMITS = sandbox.Limits(wall_s=90, cpu_s=60)
PER_TEST_TIMEOUT_S = 10


def _pytest_args(paths: list[str], report: str | None, per_test_s: float) -> list[str]:
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


def run_pytest(
    workdir: str,
    paths: list[str],
    *,
    limits: sandbox.Limits,
    isolation: str = "auto",
    hide: tuple[str, ...] = (),
    report: str | None = None,
    per_test_s: float = PER_TEST_TIMEOUT_S,
) -> sandbox.RunResult:
    """``pytest -q PATHS`` in ``workdir`` (its root importable), sandboxed."""
    return sandbox.run_python(
        _RUN_PYTEST,
        _pytest_args(paths, report, per_test_s),
        workspace=workdir,
        limits=limits,
        isolation=isolation,
        env=_PYTEST_ENV,
        hide=hide,
    )


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
    package: str,
    hidden_tests: Mapping[str, Path],
    workdir: str,
    *,
    isolation: str = "auto",
    limits: sandbox.Limits = EVAL_LIMITS,
    per_test_s: float = PER_TEST_TIMEOUT_S,
    hide: tuple[str, ...] = (),
) -> Judgement:
    """Run ``hidden_tests`` (group -> test module) against ``workdir``'s ``package``; passed
    tests per group. Only the package's ``.py`` files are copied next to the tests."""
    with tempfile.TemporaryDirectory(prefix="gyre-repo-eval-") as tmp:
        copied = _copy_package(workdir, package, tmp)
        if not copied:
            return Judgement(
                dict.fromkeys(hidden_tests, 0), f"no package {package}/ in the workspace"
            )
        tests = os.path.join(tmp, "hidden_tests")
        os.makedirs(tests)
        modules = {}
        for group, path in hidden_tests.items():
            shutil.copyfile(path, os.path.join(tests, f"test_{group}.py"))
            modules[f"test_{group}"] = group
        res = run_pytest(
            tmp,
            ["hidden_tests"],
            limits=limits,
            isolation=isolation,
            hide=hide,
            report="report.xml",
            per_test_s=per_test_s,
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
