"""Pure core, thin orchestration: only flows, the Prefect task modules and the cell
layer may import prefect or distributed (STYLE.md habit 1)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ORCHESTRATION = {
    "flows/rl_run.py",
    "flows/cli.py",
    "tasks/rollout.py",
    "tasks/process.py",
    "tasks/train_step.py",
    "infra/cluster.py",
}
FORBIDDEN = ("prefect", "prefect_dask", "distributed", "dask")


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_pure_modules_import_no_orchestration():
    checked = 0
    for pkg in ("flows", "tasks", "storage", "infra"):
        for f in sorted((ROOT / pkg).glob("*.py")):
            rel = f.relative_to(ROOT).as_posix()
            if rel in ORCHESTRATION:
                continue
            bad = _imports(f) & set(FORBIDDEN)
            assert not bad, f"{rel} imports {sorted(bad)}: move it behind a task or flow"
            checked += 1
    assert checked >= 20
