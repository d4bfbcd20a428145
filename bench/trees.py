"""Trajectory-tree build speed on one long rollout, and how much the tree saves.

A synthetic xLong rollout (default: 500 calls reaching 1M unique tokens, with
retries every 25 calls and context resets every 250, so the calls' contexts sum
to well over 100M tokens) is built into a ``TrajectoryTree`` from its delta
records on one core, record by record, with token ids as Python lists (as read
back from Parquet; numpy-array records are timed too). Target: the build takes <= 2 s (i.e. >= 500K tokens/s).
Also timed: the token-level layout (``flatten``), the ``nodes`` rows, and samples.

    python bench/trees.py [--quick] [--calls 500] [--tokens 1000000] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tasks.trajectory.sampler import build_samples
from tasks.trajectory.synth import long_rollout
from tasks.trajectory.tree import TrajectoryTree

TARGET_BUILD_S = 2.0


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (< 1 min)")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 7)

    t0 = time.perf_counter()
    records = long_rollout(n_calls=args.calls, unique_tokens=args.tokens, reset_every=250)
    gen_s = time.perf_counter() - t0

    # as read back from Parquet (Arrow to_pylist): token ids are Python lists
    as_lists = [
        dataclasses.replace(
            r,
            new_input_ids=r.new_input_ids.tolist(),  # type: ignore[union-attr]
            output_ids=r.output_ids.tolist(),  # type: ignore[union-attr]
            output_logprobs=r.output_logprobs.tolist(),  # type: ignore[union-attr]
        )
        for r in records
    ]

    def build(recs) -> TrajectoryTree:
        tree = TrajectoryTree("long")
        for r in recs:  # one record at a time, as they arrive
            tree.add(r)
        return tree

    build_s, tree = timed(lambda: build(as_lists), repeats)
    build_np_s, _ = timed(lambda: build(records), repeats)
    assert isinstance(tree, TrajectoryTree)
    flatten_s, _ = timed(tree.flatten, repeats)
    rows_s, rows = timed(tree.node_rows, 1)
    samples_s, _ = timed(lambda: build_samples([tree], {"long": 1.0}, advantage="reward"), 1)
    res = {
        "calls": float(len(records)),
        "unique_tokens": float(tree.n_tokens),
        "flat_tokens": float(tree.n_flat_tokens),
        "nodes": float(len(rows)),  # type: ignore[arg-type]
        "tree_build_s": build_s,
        "tree_build_target_s": TARGET_BUILD_S * tree.n_tokens / 1_000_000,
        "tree_build_tokens_per_s": tree.n_tokens / build_s,
        "tree_build_flat_tokens_per_s": tree.n_flat_tokens / build_s,
        "tree_build_numpy_records_s": build_np_s,
        "unique_over_flat_tokens": tree.n_tokens / tree.n_flat_tokens,
        "flatten_s": flatten_s,
        "node_rows_s": rows_s,
        "build_samples_s": samples_s,
        "synth_records_s": gen_s,
    }
    print(f"{'metric':<32}{'value':>18}")
    for k, v in res.items():
        print(f"{k:<32}{v:>18.6g}")
    ok = build_s <= res["tree_build_target_s"]
    print(
        f"build {build_s:.3f} s vs target {res['tree_build_target_s']:.2f} s: {'OK' if ok else 'MISSED'}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "trees", "quick": args.quick, **res}, f, indent=2)
    return res


if __name__ == "__main__":
    main()
