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
| **the loop**: rollouts, steps, held-out evaluations | the seconds ``<mode>: N steps in`` prints |
| report and pictures, learning curve, summary, cells torn down | ``summary: {`` |
| Prefect server stopped, exit | the process's exit |

Everything but the loop is fixed start-up and shut-down: ``smoke_fixed_share`` is that
over the wall time (the median over the runs, as every figure here);
``smoke_startup_share`` counts the start-up alone (the three phases before the loop).

CPU seconds per phase are the run's own: its process and every process under it (the
Prefect server, the cells) at each boundary line, and the exit phase from the run's rusage
once it is reaped. ``smoke_fixed_share_floor`` is the share the fixed phases would have if
their CPU seconds ran on every core of this host at once, with nothing waiting: the lowest
share this host allows for the work they do (``fixed CPU / cores`` against the loop's wall).

The host is usually shared: read the shares, and compare two versions in the same period,
alternating them (``--repo`` runs another checkout's ``flows.cli``, e.g. a ``git worktree``
of an older commit; ``--prefect-api`` uses a running Prefect server):

    python bench/smoke.py [--quick] [--runs 3] [--repo DIR] [--prefect-api URL] [--json PATH]
                          [key=value ...]

``--quick``: one run. Extra ``key=value`` settings go to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import psutil

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
    "report_summary_teardown": "report and pictures, learning curve, summary, cells torn down",
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


LOOP_SECONDS = re.compile(r"- \w+: \d+ steps in ([\d.]+)s")


def loop_as_timed(ph: dict[str, float], lines: list[tuple[float, str]]) -> dict[str, float]:
    """The loop as the scheduling flow times it (the seconds its last line prints, which
    leave out the report it writes before printing): what the loop phase holds beyond them
    moves to the shut-down phase after it, so that no fixed work counts as the loop."""
    timed = next((float(m[1]) for _, s in lines if (m := LOOP_SECONDS.search(s))), None)
    if timed is None or timed >= ph[LOOP]:
        return ph
    out = dict(ph)
    out["report_summary_teardown"] = round(ph["report_summary_teardown"] + ph[LOOP] - timed, 2)
    out[LOOP] = timed
    return out


def fixed_share(ph: dict[str, float]) -> float:
    """Fixed start-up and shut-down (everything but the loop) over the wall time."""
    wall = sum(ph.values())
    return (wall - ph[LOOP]) / wall


def startup_share(ph: dict[str, float]) -> float:
    """Fixed start-up alone (every phase before the loop) over the wall time."""
    names = list(ph)
    return sum(ph[k] for k in names[: names.index(LOOP)]) / sum(ph.values())


def tree_cpu_s(proc: psutil.Process) -> float:
    """CPU seconds (user + system) of ``proc`` and every live process under it, plus what
    they reaped."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:  # it ended between the listing and the read
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def run_once(
    repo: str, store: str, settings: list[str], prefect_api: str | None = None
) -> tuple[dict[str, float], float, dict[str, float]]:
    """One ``gyre run --preset tiny``: its phases' seconds, its wall time, and its phases'
    CPU seconds. ``prefect_api``: a running Prefect server's API URL (else the run starts
    its own temporary one)."""
    env = {**os.environ, "PYTHONPATH": repo}
    env.pop("PREFECT_API_URL", None)  # its own temporary server, as a user's first run
    if prefect_api:  # the user's `prefect server start`, as the README's UI section has it
        env["PREFECT_API_URL"] = prefect_api
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
    ps = psutil.Process(proc.pid)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines, cpu_lines = [], []
    for line in proc.stdout:
        lines.append((time.monotonic() - t0, line.rstrip("\n")))
        seen = cpu_lines[-1][0] if cpu_lines else 0.0
        try:
            # never less than before: a process that ends unreaped by the run (the cells'
            # zygote, reaped by init once the run exits) leaves the tree with its CPU
            cpu_lines.append((max(seen, tree_cpu_s(ps)), line.rstrip("\n")))
        except psutil.Error:  # the run's process is gone: its last lines
            cpu_lines.append((seen, line.rstrip("\n")))
    rc = proc.wait()
    end = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc != 0:
        tail = "\n".join(f"{t:7.2f} {s}" for t, s in lines[-30:])
        raise RuntimeError(f"gyre run exited with {rc}:\n{tail}")
    total_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    wall = loop_as_timed(phases(lines, end), lines)
    return wall, end, phases(cpu_lines, max(total_cpu, cpu_lines[-1][0]))


def fixed_share_floor(ph: dict[str, float], cpu: dict[str, float], cores: int) -> float:
    """The fixed share if the fixed phases' CPU seconds ran on all ``cores`` at once."""
    fixed = (sum(cpu.values()) - cpu[LOOP]) / cores
    return fixed / (fixed + ph[LOOP])


def table(runs: list[dict[str, float]], cpus: list[dict[str, float]] | None = None) -> str:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    wall = statistics.median(sum(r.values()) for r in runs)
    cpu = {k: statistics.median(c[k] for c in cpus) for k in cpus[0]} if cpus else None
    rows = ["| phase | seconds | share | CPU seconds |", "| --- | ---: | ---: | ---: |"]
    for k, v in med.items():
        c = f"{cpu[k]:.1f}" if cpu else ""
        rows.append(f"| {LABELS[k]} | {v:.1f} | {v / wall:.0%} | {c} |")
    share = statistics.median(fixed_share(r) for r in runs)
    total_cpu = f"{statistics.median(sum(c.values()) for c in cpus):.1f}" if cpus else ""
    rows.append(f"| total (median of {len(runs)}) | {wall:.1f} | 100% | {total_cpu} |")
    start = statistics.median(startup_share(r) for r in runs)
    rows.append(f"| fixed start-up (the phases before the loop) | | **{start:.0%}** | |")
    rows.append(f"| fixed start-up and shut-down (all but the loop) | | **{share:.0%}** | |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one run")
    ap.add_argument("--repo", default=REPO, help="the checkout whose `gyre run` is measured")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument(
        "--prefect-api",
        metavar="URL",
        help="a running Prefect server's API (e.g. http://127.0.0.1:4200/api); default: each "
        "run starts its own temporary server, as a user's first `gyre run` does",
    )
    ap.add_argument("settings", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    n = 1 if args.quick else args.runs
    runs, cpus = [], []
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="gyre-smoke-") as tmp:
        for i in range(n):
            ph, wall, cpu = run_once(
                os.path.abspath(args.repo), f"{tmp}/store{i}", args.settings, args.prefect_api
            )
            print(
                f"run {i + 1}/{n}: {wall:.1f}s, start-up {startup_share(ph):.0%}, "
                f"fixed {fixed_share(ph):.0%} (floor on {cores} "
                f"cores {fixed_share_floor(ph, cpu, cores):.0%}): "
                + ", ".join(f"{k} {v:.1f}s/{cpu[k]:.1f}cpu" for k, v in ph.items()),
                flush=True,
            )
            runs.append(ph)
            cpus.append(cpu)
    print(table(runs, cpus))
    out = {
        "smoke_wall_s": round(statistics.median(sum(r.values()) for r in runs), 1),
        "smoke_fixed_share": round(statistics.median(fixed_share(r) for r in runs), 3),
        "smoke_startup_share": round(statistics.median(startup_share(r) for r in runs), 3),
        "smoke_fixed_share_floor": round(
            statistics.median(
                fixed_share_floor(r, c, cores) for r, c in zip(runs, cpus, strict=True)
            ),
            3,
        ),
        "smoke_cores": cores,
        "smoke_cpu_s": round(statistics.median(sum(c.values()) for c in cpus), 1),
        "smoke_fixed_cpu_s": round(statistics.median(sum(c.values()) - c[LOOP] for c in cpus), 1),
        "smoke_loop_cpu_s": round(statistics.median(c[LOOP] for c in cpus), 1),
        "smoke_loop_s": round(statistics.median(r[LOOP] for r in runs), 1),
        **{
            f"smoke_{k}_s": round(statistics.median(r[k] for r in runs), 1)
            for k in runs[0]
            if k != LOOP
        },
        "runs": runs,
        "runs_cpu_s": cpus,
        "repo": os.path.abspath(args.repo),
        "prefect_api": args.prefect_api,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
