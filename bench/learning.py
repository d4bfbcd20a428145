"""Does RL add on top of the warm start? The demo against its frozen-weights control.

For each seed, two runs of ``gyre run --preset demo`` (the command a user runs, as a
subprocess) on identical tasks: the demo itself, and its control with the learning rate at
1e-12 (weights frozen in effect; everything else, tasks, sampling seeds and held-out seeds,
identical). Both start from the same warm start (``gyre warmstart``, built once and cached)
and are evaluated greedily on the same held-out tasks before the first step and every
``eval.every`` steps (tasks/env/heldout.py). Figures come from each run's ``summary.json``.

The control's noise is the spread of its own before -> after change over the seeds (greedy
evaluation of frozen weights moves only by near-ties of the argmax); a seed "beats its
control" when its gain exceeds the control's gain by more than that noise.

    python bench/learning.py [--quick] [--seeds 0 1 2] [--json PATH]

``--quick``: one seed, 2 steps of one group of 4, a 20-step warm start and 4 held-out
tasks, the demo and its control side by side (the plumbing, not the figure; under a minute
once the warm start is cached). Full runs go one after the other, so neither slows the other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONTROL_LR = "1e-12"


def run(store: str, run_id: str, seed: int, extra: list[str]) -> dict[str, Any]:
    """One ``gyre run --preset demo``; returns its summary.json."""
    cmd = [sys.executable, "-m", "flows.cli", "run", "--preset", "demo", "--store", store]
    cmd += [f"run_id={run_id}", f"rollout.seed={seed}", f"train.seed={seed}", *extra]
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    summary = json.loads((Path(store) / "runs" / run_id / "summary.json").read_text())
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--store", help="where the runs go (default: a temporary directory)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    seeds = args.seeds[:1] if args.quick else args.seeds
    quick = ["train.steps=2", "eval.every=2", "eval.tasks=4", "warmstart.steps=20"]
    quick += ["rollout.groups_per_step=1", "rollout.group_size=4"]
    extra = quick if args.quick else []
    store = args.store or tempfile.mkdtemp(prefix="gyre-bench-learning-")
    rows = []
    for seed in seeds:
        with ThreadPoolExecutor(2 if args.quick else 1) as pool:
            rl_f = pool.submit(run, store, f"demo-s{seed}", seed, extra)
            ctl_f = pool.submit(
                run, store, f"control-s{seed}", seed, [*extra, f"train.lr={CONTROL_LR}"]
            )
            rl, ctl = rl_f.result(), ctl_f.result()
        rows.append({"seed": seed, "rl": rl, "control": ctl})
        print(
            f"seed {seed}: demo {rl['reward_before']:.3f} -> {rl['reward_after']:.3f}, "
            f"control {ctl['reward_before']:.3f} -> {ctl['reward_after']:.3f} "
            f"({rl['wall_s']:.0f}s + {ctl['wall_s']:.0f}s)",
            flush=True,
        )
    gains = [r["rl"]["reward_after"] - r["rl"]["reward_before"] for r in rows]
    ctl_gains = [r["control"]["reward_after"] - r["control"]["reward_before"] for r in rows]
    noise = statistics.pstdev(ctl_gains) if len(ctl_gains) > 1 else 0.0
    beats = [g - c > noise for g, c in zip(gains, ctl_gains, strict=True)]
    print()
    print("| seed | before | after | gain | control after | control gain | curve | s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for r, g, c in zip(rows, gains, ctl_gains, strict=True):
        rl, ctl = r["rl"], r["control"]
        print(
            f"| {r['seed']} | {rl['reward_before']:.3f} | {rl['reward_after']:.3f} | {g:+.3f} "
            f"| {ctl['reward_after']:.3f} | {c:+.3f} | {rl['curve']} | {rl['wall_s']:.0f} |"
        )
    out = {
        "seeds": seeds,
        "quick": args.quick,
        "reward_before": statistics.mean(r["rl"]["reward_before"] for r in rows),
        "reward_after": statistics.mean(r["rl"]["reward_after"] for r in rows),
        "reward_gain": statistics.mean(gains),
        "control_reward_after": statistics.mean(r["control"]["reward_after"] for r in rows),
        "control_gain": statistics.mean(ctl_gains),
        "control_noise": noise,
        "min_gain_over_control": min(g - c for g, c in zip(gains, ctl_gains, strict=True)),
        "seeds_beating_control": sum(beats),
        "demo_wall_s_median": statistics.median(r["rl"]["wall_s"] for r in rows),
        "runs": [
            {
                "seed": r["seed"],
                **{f"rl_{k}": r["rl"].get(k) for k in ("reward_before", "reward_after", "curve")},
                **{f"control_{k}": r["control"].get(k) for k in ("reward_before", "reward_after")},
            }
            for r in rows
        ],
        "store": store,
    }
    print(
        f"\nmean gain {out['reward_gain']:+.3f} vs control {out['control_gain']:+.3f} "
        f"(noise {noise:.3f}); {sum(beats)}/{len(beats)} seeds beat their control"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
