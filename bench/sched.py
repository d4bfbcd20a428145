"""Colocate vs async vs elastic at equal policy lag, against the bound no scheduler can pass.

The same policy objects (tasks/sched/modes.py) drive the discrete-event
simulator (tasks/sched/simulator.py) on workloads read from bench/workloads/
(format: bench/workloads/README.md). Every mode sees the same rollouts and pays
the same costs; a run is a fixed amount of work (``steps`` steps of ``batch``
samples) and throughput is that work over the time it took.

Fair by construction:

- lag is measured in one unit for every mode (weight versions between a
  token's generation and the step that trains it; token-weighted mean, max)
  and every mode is held to the same bound ``L`` (colocate is at 0);
- async is a fixed split in two forms, batch (step b trains batch b) and
  streaming (oldest finished samples, lag gate), at the split that was best in
  hindsight and at a split chosen in advance from the workload's first hour (a
  pilot of the streaming form on the workload as it looks then, growth and
  waves not yet seen);
- ``upper_bound``: no scheduler passes it at the lag bound on the seeds run
  (proven on their realized durations, tasks/sched/bound.py); ``bound_estimate``
  is the earlier expected-value model, close to what the best modes reach but
  not a bound (a seed can pass it).

Figures are medians over seeds; ratios are of median whole-run samples/h.

    python bench/sched.py [--quick] [--json PATH] [--workload FILE ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tasks.sched import presets
from tasks.sched.bound import estimate, upper_bound
from tasks.sched.simulator import simulate
from tasks.sched.workload import Workload, load_workload

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = os.path.join(HERE, "workloads")
ROW_ORDER = (
    "reference",
    "growth",
    "stationary",
    "bursty",
    "tail_heavy",
    "train_heavy",
    "rollout_heavy",
    "costly_switches",
    "small",
    "coarse",
)
SPLITS = (0.25, 0.375, 0.5, 0.625, 0.75, 0.875)


class Runner:
    """Runs (policy, workload) over seeds once; medians of every metric."""

    def __init__(self, seeds: list[int], verbose: bool = True) -> None:
        self.seeds = seeds
        self.verbose = verbose
        self._cache: dict[tuple, dict[str, float]] = {}
        self.runs = 0

    def __call__(
        self, pol, w: Workload, seeds: list[int] | None = None, calibrate: bool = True
    ) -> dict[str, float]:
        seeds = self.seeds if seeds is None else seeds
        key = (repr(pol), repr(w), tuple(seeds), calibrate)
        if key not in self._cache:
            runs = [simulate(pol, w, seed=s, calibrate=calibrate) for s in seeds]
            self.runs += len(runs)
            out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            for k in ("lag_max", "sessions_broken", "max_switches_one_cell", "wasted_switches"):
                out[k] = max(r[k] for r in runs)
            self._cache[key] = out
        return self._cache[key]


def seeds_for(w: Workload, quick: bool) -> list[int]:
    """More seeds where a batch is small (its longest rollout varies more)."""
    if quick:
        return [0]
    return [0, 1, 2, 3, 4] if w.batch <= 512 else [0]


def split_grid(w: Workload, fracs: tuple[float, ...]) -> list[int]:
    if w.cells <= 16:
        return list(range(1, w.cells))
    return sorted({presets.split_cells(w, f) for f in fracs})


def best_split(run: Runner, w: Workload, lag: int, fracs, seeds=None) -> tuple[int, dict]:
    """The streaming async split with the most samples/h on ``w`` (coarse grid, then refine)."""
    grid = split_grid(w, fracs)
    res = {k: run(presets.async_stream(w, k, lag), w, seeds) for k in grid}
    k = max(res, key=lambda k: (res[k]["samples_per_hour"], k))
    if w.cells > 16:  # refine between the best and its neighbours
        i = grid.index(k)
        for j in (i - 1, i + 1):
            if 0 <= j < len(grid):
                mid = (grid[i] + grid[j]) // 2
                if mid not in res:
                    res[mid] = run(presets.async_stream(w, mid, lag), w, seeds)
        k = max(res, key=lambda k: (res[k]["samples_per_hour"], k))
    return k, res


def compare(run: Runner, w: Workload, lag: int, fracs, quick: bool) -> dict:
    """Every mode on ``w`` at lag bound ``lag``, ratios, and the bound."""
    seeds = seeds_for(w, quick)
    k_best, grid = best_split(run, w, lag, fracs, seeds)
    pilot_w = presets.pilot(w)  # the first hour, 16 steps: the rule bench/modes.py shares
    k_adv, _ = best_split(run, pilot_w, lag, fracs, seeds)

    def async_at(k: int) -> dict:
        st = grid.get(k) or run(presets.async_stream(w, k, lag), w, seeds)
        ba = run(presets.async_batch(w, k, lag), w, seeds)
        m = dict(max(st, ba, key=lambda r: r["samples_per_hour"]))
        m["rollout_cells"] = float(k)
        m["stream_samples_per_hour"] = st["samples_per_hour"]
        m["batch_samples_per_hour"] = ba["samples_per_hour"]
        return m

    modes = {
        "colocate": run(presets.colocate(w), w, seeds),
        "async": async_at(k_adv),
        "async_best": async_at(k_best),
        "elastic": run(presets.elastic(w, lag), w, seeds),
    }
    b = upper_bound(w, lag, seeds)
    est = estimate(w, lag).whole_run_per_hour
    el = modes["elastic"]["samples_per_hour"]

    def ratio(x: float, y: float) -> float:
        return x / y if y else float("inf")

    row = {
        "workload": w.name,
        "cells": w.cells,
        "batch": w.batch,
        "lag_bound": lag,
        "seeds": seeds,
        "upper_bound": b.whole_run_per_hour,
        "upper_bound_steady": b.steady_per_hour,
        "bound_estimate": est,
        "elastic_over_estimate": ratio(el, est),
        "async_split_advance": k_adv,
        "async_split_best": k_best,
        "elastic_over_colocate": ratio(el, modes["colocate"]["samples_per_hour"]),
        "elastic_over_async": ratio(el, modes["async"]["samples_per_hour"]),
        "elastic_over_async_best": ratio(el, modes["async_best"]["samples_per_hour"]),
        "elastic_over_bound": ratio(el, b.whole_run_per_hour),
        "async_best_over_bound": ratio(
            modes["async_best"]["samples_per_hour"], b.whole_run_per_hour
        ),
        "bound_over_async": ratio(b.whole_run_per_hour, modes["async"]["samples_per_hour"]),
        "modes": modes,
        "async_by_split": {str(k): v["samples_per_hour"] for k, v in sorted(grid.items())},
    }
    if run.verbose:
        print(
            f"  [{w.name}, {w.cells} cells, lag <= {lag}: elastic {el:.1f}/h, "
            f"/bound {row['elastic_over_bound']:.3f}, /async {row['elastic_over_async']:.2f}, "
            f"/async best {row['elastic_over_async_best']:.2f}; {run.runs} runs so far]",
            flush=True,
        )
    return row


# ---- printing ---------------------------------------------------------------------------

MODE_COLS = (
    ("samples_per_hour", "samples/h", "{:.1f}"),
    ("steady_per_hour", "steady/h", "{:.1f}"),
    ("lag_mean", "lag", "{:.2f}"),
    ("lag_max", "lag max", "{:.0f}"),
    ("idle_fraction", "idle", "{:.3f}"),
    ("switching_fraction", "switching", "{:.3f}"),
    ("switches_per_cell_day", "sw/cell-day", "{:.1f}"),
    ("sessions_broken", "broken", "{:.0f}"),
)


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(x.rjust(w) for x, w in zip(r, widths, strict=True))  # noqa: E731
    return "\n".join([line(head), *(line(r) for r in rows)])


def print_compare(title: str, r: dict) -> None:
    print(
        f"\n== {title}: {r['workload']}, {r['cells']} cells, batch {r['batch']}, lag <= {r['lag_bound']}"
    )
    rows = []
    names = {
        "colocate": "colocate",
        "async": f"async (advance split {r['async_split_advance']})",
        "async_best": f"async (best split {r['async_split_best']})",
        "elastic": "elastic",
    }
    for m, label in names.items():
        x = r["modes"][m]
        rows.append([label] + [fmt.format(x[k]) for k, _, fmt in MODE_COLS])
    rows.append(
        ["upper bound", f"{r['upper_bound']:.1f}", f"{r['upper_bound_steady']:.1f}"] + [""] * 6
    )
    print(_table(["mode"] + [c[1] for c in MODE_COLS], rows))
    print(
        "elastic / colocate {elastic_over_colocate:.2f}x, / async {elastic_over_async:.2f}x, "
        "/ async best {elastic_over_async_best:.2f}x, / bound {elastic_over_bound:.3f}; "
        "bound / async {bound_over_async:.2f}x".format(**r)
    )


def print_rows(title: str, rows: dict[str, dict]) -> None:
    head = [
        "row",
        "cells",
        "bound/h",
        "elastic/h",
        "el/bound",
        "el/colocate",
        "el/async",
        "el/async best",
        "bound/async",
        "split adv/best",
    ]
    out = []
    for name, r in rows.items():
        out.append(
            [
                name,
                str(r["cells"]),
                f"{r['upper_bound']:.1f}",
                f"{r['modes']['elastic']['samples_per_hour']:.1f}",
                f"{r['elastic_over_bound']:.3f}",
                f"{r['elastic_over_colocate']:.2f}",
                f"{r['elastic_over_async']:.2f}",
                f"{r['elastic_over_async_best']:.2f}",
                f"{r['bound_over_async']:.2f}",
                f"{r['async_split_advance']}/{r['async_split_best']}",
            ]
        )
    print(f"\n== {title}")
    print(_table(head, out))


# ---- sections ---------------------------------------------------------------------------


def lag_curve(run: Runner, w: Workload, lags: list[int], fracs, quick: bool) -> dict:
    """Samples/h of each mode at each lag bound (async at its best split there)."""
    seeds = seeds_for(w, quick)
    out: dict[str, dict] = {}
    co = run(presets.colocate(w), w, seeds)
    for lag in lags:
        k, grid = best_split(run, w, lag, fracs, seeds)
        ba = run(presets.async_batch(w, k, lag), w, seeds)
        el = run(presets.elastic(w, lag), w, seeds)
        out[str(lag)] = {
            "upper_bound": upper_bound(w, lag, seeds).whole_run_per_hour,
            "bound_estimate": estimate(w, lag).whole_run_per_hour,
            "colocate": co["samples_per_hour"],  # lag 0 whatever the bound
            "async_stream_best": grid[k]["samples_per_hour"],
            "async_batch": ba["samples_per_hour"],
            "async_split": k,
            "elastic": el["samples_per_hour"],
            "elastic_lag_mean": el["lag_mean"],
            "elastic_lag_max": el["lag_max"],
            "async_lag_mean": grid[k]["lag_mean"],
            "async_lag_max": max(grid[k]["lag_max"], ba["lag_max"]),
        }
    head = [
        "lag bound",
        "bound/h",
        "colocate",
        "async batch",
        "async stream",
        "elastic",
        "el/bound",
    ]
    rows = [
        [
            L,
            f"{r['upper_bound']:.1f}",
            f"{r['colocate']:.1f}",
            f"{r['async_batch']:.1f}",
            f"{r['async_stream_best']:.1f} ({r['async_split']})",
            f"{r['elastic']:.1f}",
            f"{r['elastic'] / r['upper_bound']:.3f}",
        ]
        for L, r in out.items()
    ]
    print(f"\n== throughput vs lag bound: {w.name}, {w.cells} cells (colocate is at lag 0)")
    print(_table(head, rows))
    return out


def ablations(run: Runner, w: Workload, lag: int, fracs, quick: bool) -> dict:
    """What each part of elastic adds (the seed's ablations, plus KV move)."""
    seeds = seeds_for(w, quick)
    base = run(presets.elastic(w, lag), w, seeds)["samples_per_hour"]
    k, grid = best_split(run, w, lag, fracs, seeds)
    rows: dict[str, dict] = {}
    rows["elastic"] = {"samples_per_hour": base}
    rows["no streaming (batch steps by index)"] = run(
        presets.elastic(w, lag, streaming=False), w, seeds
    )
    block = max(1, w.cells // 8)
    rows[f"no per-cell allocation (blocks of {block} cells)"] = run(
        presets.elastic(w, lag, block=block), w, seeds
    )
    rows[f"no role moves (streaming, fixed best split {k})"] = grid[k]
    rows["re-prefill instead of KV move"] = run(
        presets.elastic(w, lag), dataclasses.replace(w, kv_move=False), seeds
    )
    table_rows = [
        [n, f"{r['samples_per_hour']:.1f}", f"{r['samples_per_hour'] / base:.3f}"]
        for n, r in rows.items()
    ]
    print(f"\n== ablations: {w.name}, {w.cells} cells, lag <= {lag}")
    print(_table(["variant", "samples/h", "of elastic"], table_rows))
    gran: dict[str, dict] = {}
    for g in (1,) if quick else (1, 2, 4, 8):  # the quick run skips the sweep
        try:
            wg = w.regrain(g * w.devices_per_cell) if g > 1 else w
        except ValueError:
            continue
        r = compare(run, wg, lag, fracs, quick)
        gran[str(g)] = {
            "cells": wg.cells,
            "upper_bound": r["upper_bound"],
            "elastic": r["modes"]["elastic"]["samples_per_hour"],
            "async_best": r["modes"]["async_best"]["samples_per_hour"],
            "elastic_over_async_best": r["elastic_over_async_best"],
            "elastic_over_bound": r["elastic_over_bound"],
        }
    head = [
        "devices/cell",
        "cells",
        "bound/h",
        "elastic/h",
        "async best/h",
        "el/async best",
        "el/bound",
    ]
    print(f"\n== cell granularity: {w.name}, same devices")
    print(
        _table(
            head,
            [
                [
                    g,
                    str(r["cells"]),
                    f"{r['upper_bound']:.1f}",
                    f"{r['elastic']:.1f}",
                    f"{r['async_best']:.1f}",
                    f"{r['elastic_over_async_best']:.2f}",
                    f"{r['elastic_over_bound']:.3f}",
                ]
                for g, r in gran.items()
            ],
        )
    )
    return {
        "variants": {n: r["samples_per_hour"] / base for n, r in rows.items()},
        "granularity": gran,
    }


POLICY_ROWS = ("growth", "bursty", "costly-switches", "train-heavy", "reference")


def policy_ablations(run: Runner, rows: dict[str, dict], ws: dict[str, Workload]) -> dict:
    """Issue 17's policy parts, each off in turn, on the rows where demand moves.

    ``no calibration``: the policy keeps its configured costs (the simulator's are
    right, except where training follows rollout length); ``no trips in sizing``:
    training staffed at the fastest step, its members' round trips not counted.
    """
    out: dict[str, dict] = {}
    for name in POLICY_ROWS:
        if name not in rows:
            continue
        r, w = rows[name], ws[name]
        seeds = r["seeds"]
        best = r["modes"]["async_best"]["samples_per_hour"]
        variants = {
            "elastic": r["modes"]["elastic"],
            "no calibration": run(presets.elastic(w, 1), w, seeds, calibrate=False),
            "no trips in sizing": run(presets.elastic(w, 1, trip_in_sizing=False), w, seeds),
            "neither": run(presets.elastic(w, 1, trip_in_sizing=False), w, seeds, calibrate=False),
        }
        out[name] = {
            k: {
                "samples_per_hour": v["samples_per_hour"],
                "over_async_best": v["samples_per_hour"] / best,
                "over_bound": v["samples_per_hour"] / r["upper_bound"],
                "over_estimate": v["samples_per_hour"] / r["bound_estimate"],
                "wasted_switches": v["wasted_switches"],
            }
            for k, v in variants.items()
        }
    head = ["row", "variant", "samples/h", "el/async best", "el/bound", "el/estimate", "wasted sw"]
    table = [
        [
            name,
            k,
            f"{v['samples_per_hour']:.1f}",
            f"{v['over_async_best']:.3f}",
            f"{v['over_bound']:.3f}",
            f"{v['over_estimate']:.3f}",
            f"{v['wasted_switches']:.0f}",
        ]
        for name, vs in out.items()
        for k, v in vs.items()
    ]
    print("\n== policy ablations (issue 17), lag <= 1")
    print(_table(head, table))
    return out


def seed_spread(run: Runner, w: Workload, headline: dict, seeds=(1, 2)) -> dict:
    """The headline ratios on other seeds (the headline itself is one seed at 1,000 cells)."""
    k_adv, k_best = headline["async_split_advance"], headline["async_split_best"]
    out = {}
    for seed in (0, *seeds):
        el = run(presets.elastic(w, 1), w, [seed])["samples_per_hour"]

        def best_of(k: int, seed: int = seed) -> float:
            return max(
                run(presets.async_stream(w, k, 1), w, [seed])["samples_per_hour"],
                run(presets.async_batch(w, k, 1), w, [seed])["samples_per_hour"],
            )

        out[str(seed)] = {
            "elastic": el,
            "elastic_over_async": el / best_of(k_adv),
            "elastic_over_async_best": el / best_of(k_best),
            "elastic_over_bound": el / headline["upper_bound"],
        }
    print(f"\n== seeds: {w.name}, lag <= 1, splits {k_adv} (advance) / {k_best} (best)")
    print(
        _table(
            ["seed", "elastic/h", "el/async", "el/async best", "el/bound"],
            [
                [
                    sd,
                    f"{r['elastic']:.1f}",
                    f"{r['elastic_over_async']:.3f}",
                    f"{r['elastic_over_async_best']:.3f}",
                    f"{r['elastic_over_bound']:.3f}",
                ]
                for sd, r in out.items()
            ],
        )
    )
    return out


SWEEP_SIZES = (8, 32, 1000)
# issue 25's parts of the elastic policy, each off in turn (tasks/sched/modes.py)
TRANSIT_VARIANTS = {
    "no transit wait": dict(wait_for_transit=False),
    "no measured arrival": dict(plan_transit=False),
    "no lend guard": dict(lend_guard=False),
    "no size exploration": dict(explore=False),
    "none of them": dict(
        wait_for_transit=False, plan_transit=False, lend_guard=False, explore=False
    ),
}


def at_size(w: Workload, n: int, name: str, quick: bool) -> Workload:
    """``w`` on ``n`` cells under its own name; ``quick``: at most 16 steps."""
    ws = dataclasses.replace(w.resized(n), name=name)
    return dataclasses.replace(ws, steps=min(ws.steps, 16)) if quick else ws


def sweep(run: Runner, files: dict[str, Workload], sizes, fracs, quick: bool) -> dict:
    """Every workload file at each of ``sizes`` cells (``Workload.resized``: one sample per
    slot per batch), every mode at lag <= 1; ``--quick`` caps each at 16 steps."""
    out: dict[str, dict] = {}
    for n in sizes:
        rows = {}
        for name, w in files.items():
            rows[name] = compare(run, at_size(w, n, name, quick), 1, fracs, quick)
        print_rows(f"sweep: every workload file at {n} cells, lag <= 1", rows)
        out[str(n)] = rows
    return out


WORST = (
    ("worst_elastic_over_colocate", "elastic_over_colocate"),
    ("worst_elastic_over_async_best", "elastic_over_async_best"),
    ("worst_elastic_over_async", "elastic_over_async"),
    ("worst_elastic_over_bound", "elastic_over_bound"),
)


def worst_of(rows: dict[str, dict]) -> dict:
    """The least of each elastic ratio over ``rows`` and the row it is on."""
    out: dict = {}
    for key, col in WORST:
        name = min(rows, key=lambda n: rows[n][col])
        out[key] = rows[name][col]
        out[key.replace("worst_", "worst_row_")] = name
    return out


def transit_ablations(
    run: Runner, sw: dict[str, dict], files: dict[str, Workload], quick: bool
) -> dict:
    """Elastic with each of issue 25's parts off, on every sweep row: the worst ratios
    per size and the wasted switches (both moves of a recruit sent back unstepped)."""
    out: dict[str, dict] = {}
    for n, rows in sw.items():
        per: dict[str, dict] = {}
        variants = {"elastic": {}, **TRANSIT_VARIANTS}
        for vname, kw in variants.items():
            ratios = {}
            wasted = switches = 0.0
            for name, r in rows.items():
                w = at_size(files[name], int(n), name, quick)
                m = (
                    r["modes"]["elastic"]
                    if not kw
                    else run(presets.elastic(w, 1, **kw), w, r["seeds"])
                )
                el = m["samples_per_hour"]
                ratios[name] = {
                    "elastic_over_colocate": el / r["modes"]["colocate"]["samples_per_hour"],
                    "elastic_over_async_best": el / r["modes"]["async_best"]["samples_per_hour"],
                    "elastic_over_async": el / r["modes"]["async"]["samples_per_hour"],
                    "elastic_over_bound": el / r["upper_bound"],
                }
                wasted += m["wasted_switches"]
                switches += m["role_switches"]
            per[vname] = worst_of(ratios) | {
                "wasted_switches": wasted,
                "role_switches": switches,
                "by_row": {k: v["elastic_over_async_best"] for k, v in ratios.items()},
            }
        out[n] = per
    head = [
        "cells",
        "variant",
        "worst el/colocate",
        "worst el/async best",
        "worst el/bound",
        "wasted/switches",
    ]
    table = [
        [
            n,
            v,
            f"{x['worst_elastic_over_colocate']:.3f} ({x['worst_row_elastic_over_colocate']})",
            f"{x['worst_elastic_over_async_best']:.3f} ({x['worst_row_elastic_over_async_best']})",
            f"{x['worst_elastic_over_bound']:.3f} ({x['worst_row_elastic_over_bound']})",
            f"{x['wasted_switches']:.0f}/{x['role_switches']:.0f}",
        ]
        for n, per in out.items()
        for v, x in per.items()
    ]
    print("\n== issue 25 ablations: elastic with each part off, worst over every file, lag <= 1")
    print(_table(head, table))
    return out


def load_rows(paths: list[str] | None) -> dict[str, Workload]:
    if paths:
        ws = [load_workload(p) for p in paths]
        return {w.name: w for w in ws}
    files = {os.path.splitext(os.path.basename(p))[0]: p for p in glob.glob(f"{WORKLOADS}/*.y*ml")}
    order = [n for n in ROW_ORDER if n in files] + sorted(set(files) - set(ROW_ORDER))
    return {load_workload(files[n]).name: load_workload(files[n]) for n in order}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="64-cell reference, 3 rows, 1 seed (< 1 min)"
    )
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument(
        "--workload",
        action="append",
        default=None,
        help="a workload file (YAML/JSON, see bench/workloads/README.md); repeat for rows; "
        "the first is the headline",
    )
    ap.add_argument(
        "--cells", type=int, default=None, help="resize every row of the reference's size"
    )
    ap.add_argument(
        "--sections",
        default=None,
        help="default: headline,size,workload,policy,curve,ablation and (not with --quick, "
        "which stays ~1 min) sweep,transit: every workload file at --sweep-sizes cells "
        "(the worst_* figures over all of them) and issue 25's ablations",
    )
    ap.add_argument(
        "--sweep-sizes",
        default=",".join(str(n) for n in SWEEP_SIZES),
        help="cell counts the sweep runs every workload file at",
    )
    args = ap.parse_args(argv)
    if args.sections is None:
        args.sections = "headline,size,workload,policy,curve,ablation"
        if not args.quick:
            args.sections += ",sweep,transit"
    sections = set(args.sections.split(","))
    t0 = time.perf_counter()
    run = Runner([0])
    rows = load_rows(args.workload)
    every_file = dict(rows)
    ref = next(iter(rows.values()))
    ref_cells = ref.cells
    cells = args.cells or (32 if args.quick else None)

    def sized(w: Workload) -> Workload:
        if cells and w.cells == ref_cells:
            w = dataclasses.replace(w.resized(cells), name=w.name)
        if args.quick:
            w = dataclasses.replace(w, steps=min(w.steps, 16))
        return w

    if args.quick and not args.workload:
        rows = {
            n: rows[n]
            for n in ("reference", "growth", "stationary", "train-heavy", "small")
            if n in rows
        }
    rows = {n: sized(w) for n, w in rows.items()}
    ref = next(iter(rows.values()))
    fracs = (0.5, 0.75, 0.875) if args.quick else SPLITS

    out: dict = {}
    headline = compare(run, ref, 1, fracs, args.quick)
    print_compare("headline", headline)
    lag2 = compare(run, ref, 2, fracs, args.quick) if "headline" in sections else None
    if lag2:
        print_compare("headline at lag 2", lag2)
    m = headline["modes"]
    out.update(
        {
            "upper_bound": headline["upper_bound"],
            "elastic_over_colocate": headline["elastic_over_colocate"],
            "elastic_over_async": headline["elastic_over_async"],
            "elastic_over_async_best": headline["elastic_over_async_best"],
            "elastic_over_bound": headline["elastic_over_bound"],
            "lag_elastic": m["elastic"]["lag_mean"],
            "lag_elastic_max": m["elastic"]["lag_max"],
            "lag_async": m["async"]["lag_mean"],
            "lag_async_max": m["async"]["lag_max"],
            "lag_colocate": m["colocate"]["lag_mean"],
            "idle_fraction_elastic": m["elastic"]["idle_fraction"],
            "idle_fraction_colocate": m["colocate"]["idle_fraction"],
            "idle_fraction_async": m["async"]["idle_fraction"],
            "switches_per_cell_day": m["elastic"]["switches_per_cell_day"],
            "steady_per_hour_elastic": m["elastic"]["steady_per_hour"],
            "steady_per_hour_async": m["async"]["steady_per_hour"],
            "steady_per_hour_colocate": m["colocate"]["steady_per_hour"],
            "upper_bound_steady": headline["upper_bound_steady"],
            "sessions_broken_elastic": m["elastic"]["sessions_broken"],
            "headline": headline,
        }
    )
    if not args.quick and "headline" in sections:
        out["seed_spread"] = seed_spread(run, ref, headline)
    if lag2:
        out["at_lag_2"] = {k: v for k, v in lag2.items() if k != "modes"} | {"modes": lag2["modes"]}

    if "size" in sections:
        sizes = [8] if args.quick else [8, 32, 128]
        by_size = {}
        for n in sizes:
            w = dataclasses.replace(ref.resized(n), name=f"{ref.name}")
            by_size[str(n)] = compare(run, w, 1, fracs, args.quick)
        by_size[str(ref.cells)] = headline
        print_rows(
            "by size: the headline workload, lag <= 1",
            {f"{k} cells": v for k, v in by_size.items()},
        )
        out["by_size"] = by_size
    if "workload" in sections:
        by_workload = {ref.name: headline}
        for name, w in list(rows.items())[1:]:
            by_workload[name] = compare(run, w, 1, fracs, args.quick)
        print_rows("by workload, lag <= 1", by_workload)
        out["by_workload"] = by_workload
        out["worst_elastic_over_async_best"] = min(
            r["elastic_over_async_best"] for r in by_workload.values()
        )
        out["worst_row"] = min(by_workload, key=lambda n: by_workload[n]["elastic_over_async_best"])
        out["worst_elastic_over_colocate"] = min(
            r["elastic_over_colocate"] for r in by_workload.values()
        )
        if "growth" in by_workload:
            g = by_workload["growth"]
            out["growth_elastic_over_bound"] = g["elastic_over_bound"]  # the proven bound
            out["growth_elastic_over_estimate"] = g["elastic_over_estimate"]
        if "policy" in sections:
            out["policy_ablations"] = policy_ablations(run, by_workload, rows)
    if "workload" in sections:
        out["worst_elastic_over_bound"] = min(r["elastic_over_bound"] for r in by_workload.values())
    if "sweep" in sections:
        sizes = [int(x) for x in args.sweep_sizes.split(",") if x]
        sw = sweep(run, every_file, sizes, fracs, args.quick)
        out["sweep"] = {n: {k: {kk: vv for kk, vv in r.items() if kk != "modes"}
                            for k, r in rows_n.items()} for n, rows_n in sw.items()}  # fmt: skip
        out["worst_by_size"] = {n: worst_of(rows_n) for n, rows_n in sw.items()}
        every = {f"{k} @ {n}": r for n, rows_n in sw.items() for k, r in rows_n.items()}
        # over every file at every size (the figures): these replace the by-workload ones
        out.update(worst_of(every))
        if "transit" in sections:
            out["transit_ablations"] = transit_ablations(run, sw, every_file, args.quick)
    if "curve" in sections:
        lags = [1, 2] if args.quick else [0, 1, 2, 3, 4]
        out["lag_curve"] = lag_curve(run, ref, lags, fracs, args.quick)
    if "ablation" in sections:
        out["ablations"] = ablations(run, ref, 1, fracs, args.quick)

    out["wall_s"] = time.perf_counter() - t0
    out["simulations"] = run.runs
    print(
        "\n== figures (targets: el/bound >= 0.95, el/colocate >= 1.8, el/async >= 1.3, "
        "worst el/async best >= 1.0, growth el/bound >= 0.90: the proven bound; "
        "growth el/estimate beside it)"
    )
    for k, v in out.items():
        if isinstance(v, float | int) and not isinstance(v, bool):
            print(f"{k:34s} {v:.3f}")
    print(f"{'worst_row':34s} {out.get('worst_row')}")
    for k in sorted(out):
        if k.startswith("worst_row_"):
            print(f"{k:34s} {out[k]}")
    for n, x in out.get("worst_by_size", {}).items():
        print(
            f"{n + ' cells':>10s}: worst el/colocate {x['worst_elastic_over_colocate']:.3f} "
            f"({x['worst_row_elastic_over_colocate']}), el/async best "
            f"{x['worst_elastic_over_async_best']:.3f} ({x['worst_row_elastic_over_async_best']}), "
            f"el/bound {x['worst_elastic_over_bound']:.3f} ({x['worst_row_elastic_over_bound']})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
