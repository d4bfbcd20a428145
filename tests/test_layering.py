"""The layer order in pyproject.toml ([tool.importlinter]) holds, and the contracts catch
what they guard against: an import that runs upward, a circle, a pure core importing prefect.

Each planted case runs `lint-imports` on a copy of the packages with one line added.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "tasks", "storage", "infra")
LINT = [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()"]


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [*LINT, "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_contracts_hold_on_the_tree():
    res = _lint(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("KEPT") == 3, res.stdout


@pytest.fixture()
def copy(tmp_path):
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


@pytest.mark.parametrize(
    "module, line, broken",
    [
        # storage is the lowest layer: it may not reach up into infra
        ("storage/store.py", "import infra.gateway.router", "layers"),
        # a pure core reaching a Prefect task
        ("tasks/trajectory/tree.py", "import tasks.process", "layers"),
        # a circle inside one package
        ("storage/schemas.py", "import storage.store", "no import circles"),
        # a pure core importing the orchestrator
        ("tasks/sched/modes.py", "import prefect", "pure cores"),
    ],
)
def test_planted_violation_breaks_a_contract(copy, module, line, broken):
    path = copy / module
    path.write_text(path.read_text() + f"\n{line}  # planted\n")
    res = _lint(copy)
    assert res.returncode != 0, res.stdout
    broken_lines = [ln for ln in res.stdout.splitlines() if " BROKEN" in ln]
    assert any(ln.startswith(broken) for ln in broken_lines), res.stdout
