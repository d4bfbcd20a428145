"""Long-context serving on the embedded engine: one session grown ~2K tokens a call.

Measures, against the context length: engine seconds and prefilled tokens per call (the radix
cache should keep prefill to the new tokens), decode seconds per token, KV bytes per token, and
a KV move (export + import into a second engine) of the session against re-prefilling it.
Full: to 300K tokens (KV move at 100K); ``--quick``: to ~20K (KV move at the last context).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

STEP = 2000
NEW_OUT = 8


def _ids(n: int, start: int) -> list[int]:
    return [(start * 131 + 13 * i) % 900 + 5 for i in range(n)]


def measure(quick: bool) -> dict:
    """Run the session; returns the figures (top-level ``xlong_*`` keys plus per-call rows)."""
    from infra.engine.engine import Engine
    from infra.engine.tiny_model import make_tiny_model

    top = 20_000 if quick else 300_000
    move_at = top if quick else 100_000
    marks = sorted({1_000, 10_000, 20_000, 100_000, 300_000} & set(range(0, top + 1)) | {top})
    d = make_tiny_model(Path(tempfile.mkdtemp()) / "m", max_position_embeddings=1 << 20)
    eng = Engine(d, kv_cache_tokens=1 << 21)
    params = {"max_new_tokens": NEW_OUT, "temperature": 0, "ignore_eos": True}
    rows, ids, move = [], [], {}
    try:
        call = 0
        while len(ids) < top:
            ids = ids + _ids(STEP if ids else 1_000, call)
            t = time.perf_counter()
            res = eng.generate(ids, params)
            dt = time.perf_counter() - t
            meta = res["meta_info"]
            row = {
                "context": len(ids),
                "call_s": dt,
                "prefilled_tokens": len(ids) - meta["cached_tokens"],
            }
            ids = ids + res["output_ids"]
            rows.append(row)
            call += 1
            if not move and len(ids) >= move_at:
                t = time.perf_counter()
                blob = eng.export_kv(ids)
                other = Engine(d, kv_cache_tokens=1 << 21)
                try:
                    t1 = time.perf_counter()
                    got = other.import_kv(blob)
                    t2 = time.perf_counter()
                    other.generate(ids, {**params, "max_new_tokens": 1})
                    reprefill_check = time.perf_counter() - t2
                finally:
                    other.close()
                fresh = Engine(d, kv_cache_tokens=1 << 21)
                try:
                    t3 = time.perf_counter()
                    fresh.generate(ids, {**params, "max_new_tokens": 1})
                    reprefill = time.perf_counter() - t3
                finally:
                    fresh.close()
                move = {
                    "tokens": got,
                    "bytes": len(blob),
                    "export_s": t1 - t,
                    "import_s": t2 - t1,
                    "after_import_call_s": reprefill_check,
                    "reprefill_s": reprefill,
                }
        info = eng.model_info()
    finally:
        eng.close()

    def at(n: int) -> dict:
        return min(rows, key=lambda r: abs(r["context"] - n))

    hi = at(300_000 if not quick else top)
    out = {
        "xlong_serve_context_max": rows[-1]["context"],
        "xlong_kv_bytes_per_token": info["kv_bytes_per_token"],
        "xlong_kv_move_tokens": move.get("tokens"),
        "xlong_kv_move_bytes": move.get("bytes"),
        "xlong_kv_move_s_100k": move.get("export_s", 0) + move.get("import_s", 0),
        "xlong_reprefill_s_100k": move.get("reprefill_s"),
        "xlong_prefill_s_per_call_300k_over_10k": hi["call_s"] / at(10_000)["call_s"],
        "xlong_prefilled_tokens_per_call_max": max(r["prefilled_tokens"] for r in rows[1:]),
        "quick": quick,
        "kv_move": move,
        "curve": [at(m) for m in marks],
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res = measure(args.quick)
    print(f"{'context':>9} {'call s':>8} {'prefilled':>10}")
    for r in res["curve"]:
        print(f"{r['context']:>9} {r['call_s']:>8.3f} {r['prefilled_tokens']:>10}")
    for k, v in res.items():
        if k.startswith("xlong_"):
            print(f"{k}: {v}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
