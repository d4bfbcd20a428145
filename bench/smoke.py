"""The smoke test's wall time by phase: how much of ``gyre run --preset tiny`` is the loop.

Runs ``gyre run --preset tiny`` (the command a user runs, as a subprocess, with its own
temporary Prefect server) ``--runs`` times one after the other, stamps every output line
with the seconds since the command started, and cuts the run into phases at lines the run
prints anyway:

| phase | ends at the line |
| --- | --- |
| CLI, temporary Prefect server, ``rl_run`` flow begins | ``Beginning flow run`` |
| model, v0 published, cells and gateway up | ``cells and gateway up in`` |
| ``schedule`` sub-flow to its first decision (engines started in the cells) | ``<mode>: N cells (`` |
| **the loop**: rollouts, steps, held-out evaluations | ``<mode>: N steps in`` |
| report, learning curve, summary, cells torn down | ``summary: {`` |
| Prefect server stopped, exit | the process's exit |

Everything but the loop is fixed start-up and shut-down: ``smoke_fixed_share`` is that
over the wall time (the median over the runs, as every figure here). The host is usually
shared: read the shares, and compare two versions in the same period, alternating them
(``--repo`` runs another checkout's ``flows.cli``, e.g. a ``git worktree`` of an older
commit):

    python bench/smoke.py [--quick] [--runs 3] [--repo DIR] [--json PATH] [key=value ...]

``--quick``: one run. Extra ``key=value`` settings go to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (phase name, the pattern of the line that ends it); the last phase ends at the exit
PHASES = (
    ("cli_prefect_server", re.compile(r"Beginning flow run .* for flow 'rl_run'")),
    ("cells_gateway", re.compile(r"cells and gateway up in")),
    ("to_first_decision", re.compile(r"- \w+: \d+ cells \(")),
    ("loop", re.compile(r"- \w+: \d+ steps in [\d.]+s")),
    ("report_summary_teardown", re.compile(r"- summary: \{")),
)
EXIT = "exit"
LOOP = "loop"
LABELS = {
    "cli_prefect_server": "CLI, temporary Prefect server, `rl_run` flow begins",
    "cells_gateway": "model, v0 published, cells and gateway up",
    "to_first_decision": "`schedule` sub-flow to its first decision (engines started in cells)",
    "loop": "**the loop: rollouts, 2 steps, held-out v0 and v2**",
    "report_summary_teardown": "report, learning curve, summary, cells torn down",
    "exit": "Prefect server stopped, exit",
}


def phases(lines: list[tuple[float, str]], end_s: float) -> dict[str, float]:
    """Seconds of each phase from ``(seconds since start, line)`` pairs; raises ValueError
    naming the first boundary line that is missing (a failed or changed run)."""
    bounds, i = [], 0
    for name, pattern in PHASES:
        while i < len(lines) and not pattern.search(lines[i][1]):
            i += 1
        if i == len(lines):
            raise ValueError(f"no line matching {pattern.pattern!r} (the end of {name})")
        bounds.append((name, lines[i][0]))
    out, t = {}, 0.0
    for name, at in bounds:
        out[name] = round(at - t, 2)
        t = at
    out[EXIT] = round(end_s - t, 2)
    return out


def fixed_share(ph: dict[str, float]) -> float:
    """Fixed start-up and shut-down (everything but the loop) over the wall time."""
    wall = sum(ph.values())
    return (wall - ph[LOOP]) / wall


def run_once(repo: str, store: str, settings: list[str]) -> tuple[dict[str, float], float]:
    """One ``gyre run --preset tiny``: its phases and its wall time."""
    env = {**os.environ, "PYTHONPATH": repo}
    env.pop("PREFECT_API_URL", None)  # its own temporary server, as a user's first run
    cmd = [sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--store", store]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd + settings,
        cwd=repo,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    lines = []
    for line in proc.stdout:
        lines.append((time.monotonic() - t0, line.rstrip("\n")))
    rc = proc.wait()
    end = time.monotonic() - t0
    if rc != 0:
        tail = "\n".join(f"{t:7.2f} {s}" for t, s in lines[-30:])
        raise RuntimeError(f"gyre run exited with {rc}:\n{tail}")
    return phases(lines, end), end


def table(runs: list[dict[str, float]]) -> str:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    wall = statistics.median(sum(r.values()) for r in runs)
    rows = ["| phase | seconds | share |", "| --- | ---: | ---: |"]
    for k, v in med.items():
        rows.append(f"| {LABELS[k]} | {v:.1f} | {v / wall:.0%} |")
    share = statistics.median(fixed_share(r) for r in runs)
    rows.append(f"| total (median of {len(runs)}) | {wall:.1f} | 100% |")
    rows.append(f"| fixed start-up and shut-down (all but the loop) | | **{share:.0%}** |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one run")
    ap.add_argument("--repo", default=REPO, help="the checkout whose `gyre run` is measured")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("settings", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    n = 1 if args.quick else args.runs
    runs = []
    with tempfile.TemporaryDirectory(prefix="gyre-smoke-") as tmp:
        for i in range(n):
            ph, wall = run_once(os.path.abspath(args.repo), f"{tmp}/store{i}", args.settings)
            print(
                f"run {i + 1}/{n}: {wall:.1f}s, fixed {fixed_share(ph):.0%}: "
                + ", ".join(f"{k} {v:.1f}" for k, v in ph.items()),
                flush=True,
            )
            runs.append(ph)
    print(table(runs))
    out = {
        "smoke_wall_s": round(statistics.median(sum(r.values()) for r in runs), 1),
        "smoke_fixed_share": round(statistics.median(fixed_share(r) for r in runs), 3),
        "smoke_loop_s": round(statistics.median(r[LOOP] for r in runs), 1),
        **{
            f"smoke_{k}_s": round(statistics.median(r[k] for r in runs), 1)
            for k in runs[0]
            if k != LOOP
        },
        "runs": runs,
        "repo": os.path.abspath(args.repo),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
