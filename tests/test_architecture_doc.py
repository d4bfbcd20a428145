"""ARCHITECTURE.md's module map matches the tree: every module is listed, and every
listed module exists (a doc that drifts from the code is a defect)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "tasks", "storage", "infra")
# data shipped inside a package, not modules of gyre (the repo suite's specs)
DATA_DIRS = ("tasks/env/repo_specs/",)


def _modules() -> set[str]:
    out = set()
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            rel = f.relative_to(ROOT).as_posix()
            if f.name != "__init__.py" and not rel.startswith(DATA_DIRS):
                out.add(rel)
    return out


def _listed() -> set[str]:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    return set(re.findall(r"`((?:flows|tasks|storage|infra)/[\w/]+\.py)`", text))


def test_every_module_is_in_the_map():
    missing = sorted(_modules() - _listed())
    assert not missing, f"add to ARCHITECTURE.md: {missing}"


def test_every_listed_module_exists():
    gone = sorted(_listed() - _modules())
    assert not gone, f"ARCHITECTURE.md lists modules that do not exist: {gone}"
