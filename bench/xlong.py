"""xLong: one rollout of hundreds of calls and up to 1M tokens, served, stored and trained.

The issue's figures in one table, from the parts that measure them, each in its own
process (so that one part's peak memory and threads do not colour the next):

- ``bench/xlong_gateway.py``: one session of 500 calls growing ~2K tokens a call to 1M
  tokens through the real gateway on a stub engine (so engine compute cannot hide the
  gateway's): CPU per call, body bytes, resident bytes per context token, TITO bytes per
  unique token, ``gyre sql`` time of the ``transcripts`` and ``calls`` views;
- ``bench/xlong_serve.py``: the embedded engine on one growing session: prefill per call
  (only the new tokens), decode per token, KV bytes per token, a 100K-token KV move vs its
  re-prefill;
- ``bench/xlong_train.py``: one training step on one path of 4K .. 128K tokens (chunked,
  checkpointed, prefix K/V): step time, peak memory and its slope, the attention FLOP/s
  against this machine's measured matmul FLOP/s, chunked vs unchunked gradients in fp64;
- ``bench/xlong_cp.py``: one path split over k context-parallel members (gloo) vs 1;
- ``--run``: a ``gyre run --preset long`` (2 steps) as a user runs it, and the longest
  rollout it trained, read back with ``gyre sql``.

    python bench/xlong.py [--quick] [--json PATH] [--only gateway,serve,train,cp,run]

Every figure is a top-level key of the JSON; a part that fails is named in ``errors``
(the others are kept) and the exit status is 1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

PARTS = ("gateway", "serve", "train", "cp", "run")

# the targets: (op, bound); figures without one are reported as measured
TARGETS = {
    "xlong_gateway_cpu_ms_1m_over_10k": ("<=", 2.0),
    "xlong_gateway_cpu_over_parse_1m": ("<=", 3.0),
    "xlong_gateway_resident_bytes_per_token": ("<=", 16.0),
    "xlong_train_path_tokens_max": (">=", 131_072),
    "xlong_cp_grad_max_rel_diff": ("<=", 1e-5),
    "xlong_chunked_grad_max_abs_diff_fp64": ("<=", 1e-12),
    "xlong_rollout_tokens_max": (">=", 100_000),
    "xlong_rollout_calls_max": (">=", 200),
}


def _measure(part: str, quick: bool) -> dict:
    """``bench/xlong_<part>.py``'s ``measure(quick)``, run in this (child) process."""
    return importlib.import_module(f"xlong_{part}").measure(quick)


def _in_child(part: str, quick: bool) -> dict:
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(_measure, part, quick).result()


RUN_SQL = (
    "SELECT max(n_calls) AS calls, max(n_tokens_unique) AS tokens, "
    "(SELECT sum(dropped_tokens) FROM steps) AS dropped, "
    "(SELECT sum(tokens) FROM steps) AS trained FROM rollouts"
)


def measure_run(quick: bool) -> dict:
    """``gyre run --preset long`` for 2 steps in a scratch store, then its longest rollout
    (calls, unique tokens) and the tokens dropped, read with ``gyre sql`` as a user would."""
    gyre = str(Path(sys.executable).with_name("gyre"))
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        cmd = [gyre, "run", "--preset", "long", "--store", store, "run_id=xlong", "train.steps=2"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        wall = time.perf_counter() - t0
        if proc.returncode:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
            )
        q = subprocess.run(
            [gyre, "sql", "--store", store, "--format", "json", RUN_SQL],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if q.returncode:
            raise RuntimeError(f"gyre sql failed:\n{q.stderr[-2000:]}")
        row = json.loads(q.stdout.splitlines()[0])  # JSON lines, one row
    return {
        "xlong_rollout_tokens_max": int(row["tokens"]),
        "xlong_rollout_calls_max": int(row["calls"]),
        "xlong_run_tokens_dropped": int(row["dropped"] or 0),
        "xlong_run_tokens_trained": int(row["trained"] or 0),
        "xlong_run_wall_s": round(wall, 1),
    }


def _check(key: str, value) -> str:
    if key not in TARGETS or not isinstance(value, int | float):
        return ""
    op, bound = TARGETS[key]
    ok = value <= bound if op == "<=" else value >= bound
    return f"{op} {bound:g} {'ok' if ok else 'MISSED'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, about a minute a part")
    parser.add_argument("--json", type=Path, help="write the figures here (top-level keys)")
    parser.add_argument(
        "--only",
        default=",".join(p for p in PARTS if p != "run"),
        help=f"comma-separated parts of {','.join(PARTS)} (default: all but run)",
    )
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: unknown; use parts of {','.join(PARTS)}")
    figures: dict = {"bench": "xlong", "quick": args.quick}
    errors: dict[str, str] = {}
    for part in parts:
        t0 = time.perf_counter()
        print(f"== {part} ...", flush=True)
        try:
            got = measure_run(args.quick) if part == "run" else _in_child(part, args.quick)
        except Exception as e:  # a failed part is reported, the rest kept
            errors[part] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            continue
        figures.update(got)
        figures[f"xlong_{part}_bench_s"] = round(time.perf_counter() - t0, 1)
    print(f"\n{'figure':<46} {'value':>14}  target")
    for key, value in figures.items():
        if isinstance(value, list | dict):
            continue
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"{key:<46} {shown:>14}  {_check(key, value)}")
    for part, err in errors.items():
        print(f"FAILED {part}: {err}")
    if errors:
        figures["errors"] = errors
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2, default=str))
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
