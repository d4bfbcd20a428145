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

``--preset smol``: the same comparison on the real SmolLM2-135M-Instruct (`gyre run
--preset smol`: the ``story`` suite, no warm start, so the held-out "before" is the base
model), with the ``smol_*`` figures of issue 16 besides: the held-out gain and its standard
error, seconds per seed, rollout and training tokens per second, peak memory of each
process of the run (its cells included) and where the time goes (``run_costs``).
``--set key=value`` (repeatable) passes settings to both runs, e.g. a shorter run:

    python bench/learning.py --preset smol --seeds 0 --set train.steps=8 --set eval.every=4

``--rows DIR`` keeps each finished seed (its two runs' summaries, wall times, peak memory
and the store they are in) as ``DIR/PRESET-sSEED.json``; a later invocation with the same
``--rows`` reuses those seeds and runs only the missing ones, so a bench that dies on its
third seed does not cost the first two again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONTROL_LR = "1e-12"
# per preset: settings only the control gets. SmolLM2's control is frozen weights evaluated
# before and after ONE step (lr 1e-12): frozen weights are the same after 1 step as after N,
# so its "after" measures what a frozen policy's greedy evaluation does (batching near-ties)
# without spending a full run (~20 min a seed on 2 cores) to learn it.
CONTROL_ONLY = {"demo": [], "smol": ["train.steps=1", "eval.every=1"]}
# per preset: the settings of --quick (the plumbing, not the figure)
QUICK = {
    "demo": ["train.steps=2", "eval.every=2", "eval.tasks=4", "warmstart.steps=20"]
    + ["rollout.groups_per_step=1", "rollout.group_size=4"],
    "smol": ["train.steps=2", "eval.every=2", "eval.tasks=4"]
    + ["rollout.groups_per_step=1", "rollout.group_size=4"],
}
MIB = 1024 * 1024


class PeakRss:
    """Peak resident memory of a process and all its descendants, each on its own, sampled
    every ``every_s`` while a run goes on (its cells are Dask worker processes under it)."""

    def __init__(self, pid: int, every_s: float = 0.5):
        self.pid, self.every_s = pid, every_s
        self.peaks: dict[int, tuple[str, int]] = {}  # pid -> (what, peak bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                procs = []
            for p in procs:
                try:
                    rss = p.memory_info().rss
                    what = self.peaks.get(p.pid, (None, 0))[0] or _what(p, self.pid)
                except psutil.Error:
                    continue
                self.peaks[p.pid] = (what, max(rss, self.peaks.get(p.pid, ("", 0))[1]))
            self._stop.wait(self.every_s)

    def stop(self) -> list[dict[str, Any]]:
        """[{what, peak_rss_mib}], largest first."""
        self._stop.set()
        self._thread.join()
        rows = [{"what": w, "peak_rss_mib": round(b / MIB)} for w, b in self.peaks.values()]
        return sorted(rows, key=lambda r: -r["peak_rss_mib"])


def _what(p: psutil.Process, root: int) -> str:
    """A process of a ``gyre run``, named by its part."""
    if p.pid == root:
        return "gyre run (flow, gateway)"
    cmd = " ".join(p.cmdline())
    if "prefect" in cmd and "server" in cmd:
        return "prefect server"
    if "multiprocessing" in cmd or "spawn_main" in cmd or "distributed" in cmd:
        return "dask process (cell worker or nanny)"
    return p.name()


def run(
    store: str, run_id: str, seed: int, extra: list[str], preset: str = "demo"
) -> dict[str, Any]:
    """One ``gyre run --preset PRESET``; returns its summary.json, its wall time and the peak
    memory of its processes (``peak_rss``)."""
    cmd = [sys.executable, "-m", "flows.cli", "run", "--preset", preset, "--store", store]
    cmd += [f"run_id={run_id}", f"rollout.seed={seed}", f"train.seed={seed}", *extra]
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
        peaks = PeakRss(proc.pid)
        code = proc.wait()
        peak_rss = peaks.stop()
        err.seek(0)
        if code != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({code}):\n{err.read()[-3000:]}")
    summary = json.loads((Path(store) / "runs" / run_id / "summary.json").read_text())
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    summary["peak_rss"] = peak_rss
    return summary


def _union_s(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the ``(start, end)`` spans."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def run_costs(store: str, run_id: str) -> dict[str, Any]:
    """Where a run's time goes and how fast its parts are, from its own rows in the store.

    Rollout: tokens generated by training sessions per second an engine had one of their
    calls in flight (spans of their ``tito`` records, per cell, summed over cells); the
    same for held-out evaluation; prompt tokens a call had to prefill (its new input, not
    from the radix cache). Training: forward tokens per second of the ``steps`` rows'
    spans. Elastic mode overlaps rollout and training on different cells, so the parts may
    add up to more than the run's wall time."""
    from storage.sql import query
    from storage.store import Store

    st = Store(store)
    calls = query(
        st,
        "SELECT t.cell_id, t.t_start, t.t_end, len(t.output_ids) AS n_out, "
        "len(t.new_input_ids) AS n_new, t.cached_tokens, "
        "t.session_id IN (SELECT session_id FROM evals) AS is_eval "
        f"FROM tito t WHERE t.run_id = '{run_id}'",
    ).to_pylist()
    steps = query(
        st,
        "SELECT step, tokens, trainable_tokens, t_start, t_end, n_members "
        f"FROM steps WHERE run_id = '{run_id}' ORDER BY step",
    ).to_pylist()
    out: dict[str, Any] = {}
    for part, rows in (("rollout", [c for c in calls if not c["is_eval"]]),
                       ("eval", [c for c in calls if c["is_eval"]])):  # fmt: skip
        busy = sum(
            _union_s([(c["t_start"], c["t_end"]) for c in rows if c["cell_id"] == cell])
            for cell in {c["cell_id"] for c in rows}
        )
        gen = sum(c["n_out"] for c in rows)
        out[f"{part}_calls"] = len(rows)
        out[f"{part}_tokens_generated"] = gen
        out[f"{part}_prompt_tokens_new"] = sum(c["n_new"] for c in rows)
        out[f"{part}_engine_busy_s"] = round(busy, 1)
        out[f"{part}_tokens_per_s"] = round(gen / busy, 1) if busy else None
    train_s = sum(s["t_end"] - s["t_start"] for s in steps)
    tokens = sum(s["tokens"] for s in steps)
    out["train_steps"] = len(steps)
    out["train_s"] = round(train_s, 1)
    out["train_s_per_step"] = round(train_s / len(steps), 1) if steps else None
    out["train_tokens"] = tokens
    out["train_trainable_tokens"] = sum(s["trainable_tokens"] for s in steps)
    out["train_tokens_per_s"] = round(tokens / train_s, 1) if train_s else None
    return out


def _per_task(summary: dict[str, Any]) -> dict[str, dict[str, float]]:
    return summary.get("learning", {}).get("per_task", {})


def _mean_se(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return 0.0, 0.0
    se = statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else 0.0
    return statistics.mean(xs), se


def paired_gains(rows: list[dict[str, Any]]) -> tuple[float, float, float, float]:
    """(gain, its s.e., gain over the control, its s.e.), paired per held-out task over all
    seeds: after - before of the RL run, and the RL run's after - the control's after."""
    gains, over = [], []
    for r in rows:
        rl, ctl = _per_task(r["rl"]), _per_task(r["control"])
        gains += [t["after"] - t["before"] for t in rl.values()]
        over += [rl[k]["after"] - ctl[k]["after"] for k in rl if k in ctl]
    return (*_mean_se(gains), *_mean_se(over))


def smol_figures(store: str, preset: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 16's figures. The gain is paired per held-out task (the same task seeds before
    and after, and in the control): ``smol_heldout_gain`` is the mean over seeds and tasks
    of (after - before), its standard error that of those differences; the control
    comparison pairs each task's reward after RL with the control's after."""
    gain, gain_se, vs_ctl, vs_ctl_se = paired_gains(rows)
    costs = []
    for r in rows:
        c = run_costs(r.get("store", store), r["rl"]["run_id"])
        c["wall_s"] = r["rl"]["wall_s"]
        c["flow_s"] = r["rl"]["seconds"]
        # Prefect server start, the model's and cells' start-up before the flow, teardown
        c["outside_flow_s"] = round(r["rl"]["wall_s"] - r["rl"]["seconds"], 1)
        c["peak_rss"] = r["rl"]["peak_rss"]
        costs.append(c)

    def median(key: str) -> float | None:
        vals = [c[key] for c in costs if c.get(key) is not None]
        return statistics.median(vals) if vals else None

    out = {
        "smol_heldout_gain": round(gain, 4),
        "smol_heldout_gain_se": round(gain_se, 4),
        "smol_gain_over_control": round(vs_ctl, 4),
        "smol_gain_over_control_se": round(vs_ctl_se, 4),
        "smol_beats_control_by_2se": bool(vs_ctl > 2 * vs_ctl_se > 0),
        "smol_seconds_per_seed": median("wall_s"),
        "smol_control_seconds_per_seed": statistics.median(r["control"]["wall_s"] for r in rows),
        "smol_rollout_tokens_per_s": median("rollout_tokens_per_s"),
        "smol_eval_tokens_per_s": median("eval_tokens_per_s"),
        "smol_train_tokens_per_s": median("train_tokens_per_s"),
        "smol_train_s_per_step": median("train_s_per_step"),
        # the first seed whose peak memory was recorded
        "smol_peak_rss_mib": next((c["peak_rss"] for c in costs if c["peak_rss"]), []),
        "smol_costs": costs,
    }
    print(
        f"\n{preset}: held-out gain {gain:+.3f} ± {gain_se:.3f} (paired per task), "
        f"over control {vs_ctl:+.3f} ± {vs_ctl_se:.3f}; {out['smol_seconds_per_seed']} s a seed"
    )
    for c in costs:
        print(
            f"  wall {c['wall_s']} s (outside the flow {c['outside_flow_s']} s): rollout "
            f"engines busy {c['rollout_engine_busy_s']} s at {c['rollout_tokens_per_s']} "
            f"tok/s, eval {c['eval_engine_busy_s']} s at {c['eval_tokens_per_s']} tok/s, "
            f"training {c['train_s']} s at {c['train_tokens_per_s']} tok/s "
            f"({c['train_s_per_step']} s a step)"
        )
        for p in c["peak_rss"][:6]:
            print(f"    peak RSS {p['peak_rss_mib']:>6} MiB  {p['what']}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(QUICK), default="demo")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting for both runs (repeatable)")  # fmt: skip
    ap.add_argument("--store", help="where the runs go (default: a temporary directory)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--rows", metavar="DIR",
                    help="keep each finished seed's runs here (PRESET-sSEED.json) and reuse "
                         "them instead of running that seed again")  # fmt: skip
    args = ap.parse_args(argv)
    seeds = args.seeds[:1] if args.quick else args.seeds
    extra = (QUICK[args.preset] if args.quick else []) + args.set
    store = args.store or tempfile.mkdtemp(prefix="gyre-bench-learning-")
    rows_dir = Path(args.rows) if args.rows else None
    rows = []
    for seed in seeds:
        saved = rows_dir / f"{args.preset}-s{seed}.json" if rows_dir else None
        if saved is not None and saved.exists():
            # a seed finished by an earlier invocation (e.g. before the bench died on a later
            # seed): its row as that invocation wrote it, the runs in the store it names
            row = json.loads(saved.read_text())
            rows.append(row)
            print(f"seed {seed}: reused {saved} (runs in {row['store']})", flush=True)
            continue
        # side by side only for the tiny model: two SmolLM2 runs need ~16 GB together
        with ThreadPoolExecutor(2 if args.quick and args.preset == "demo" else 1) as pool:
            rl_f = pool.submit(run, store, f"{args.preset}-s{seed}", seed, extra, args.preset)
            ctl_extra = [*extra, f"train.lr={CONTROL_LR}", *CONTROL_ONLY[args.preset]]
            ctl_f = pool.submit(run, store, f"control-s{seed}", seed, ctl_extra, args.preset)
            rl, ctl = rl_f.result(), ctl_f.result()
        row = {"seed": seed, "store": store, "settings": extra, "rl": rl, "control": ctl}
        rows.append(row)
        if saved is not None:
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps(row, indent=2))
        print(
            f"seed {seed}: {args.preset} {rl['reward_before']:.3f} -> {rl['reward_after']:.3f}, "
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
    if args.preset == "smol":
        out.update(smol_figures(store, args.preset, rows))
    print(
        f"\nmean gain {out['reward_gain']:+.3f} vs control {out['control_gain']:+.3f} "
        f"(noise {noise:.3f}); {sum(beats)}/{len(beats)} seeds beat their control"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
