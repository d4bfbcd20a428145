"""Embedded engine benchmark: batching, KV migration, logprob exactness (side by side, ratios).

    python bench/engine.py [--quick] [--json PATH]

Figures (issue 3 targets):
- ``batched_over_serial_16``: throughput of 16 concurrent sessions over serving the same 16
  one by one (target >= 4); median of alternated runs.
- ``kv_move_over_prefill_8k``: time to move an 8K-token context's KV to another engine
  (export + import + a short generate) over a re-prefill of it there (the same short
  generate on a cold cache); median over repeats, alternated (target <= 0.2).
- ``logprob_max_abs_diff``: max |engine logprob - full-forward recompute| over every output
  token of a batched, mixed-sampling run (fp32; target <= 1e-4).

Each figure comes from a function in `BENCHES` returning ``(figures, details)``; another
figure (e.g. ``tito_bytes_over_unique``) is one more function appended there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from infra.engine.engine import Engine
from infra.engine.tiny_model import make_tiny_model


def _prompt(n: int, salt: int) -> list[int]:
    return [(salt * 7919 + 31 * i + (i * i) % 97) % 1000 + 5 for i in range(n)]


def bench_batching(model_dir: str, quick: bool) -> tuple[dict, dict]:
    sessions, prompt_len, new = 16, 128, (32 if quick else 96)
    repeats = 1 if quick else 3
    prompts = [_prompt(prompt_len, s) for s in range(sessions)]
    params = [
        {"max_new_tokens": new, "temperature": 0.8, "sampling_seed": s, "ignore_eos": True}
        for s in range(sessions)
    ]
    eng = Engine(model_dir, max_batch_size=sessions)
    serial_ts, batched_ts, same = [], [], True
    try:
        eng.generate(prompts[0], {"max_new_tokens": 4})  # warm-up
        for _ in range(repeats):  # side by side, alternating
            eng.flush_cache()
            t0 = time.perf_counter()
            serial = [
                eng.generate(p, sp)["output_ids"] for p, sp in zip(prompts, params, strict=True)
            ]
            serial_ts.append(time.perf_counter() - t0)
            eng.flush_cache()
            t0 = time.perf_counter()
            reqs = [eng.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
            for r in reqs:
                r.done.wait()
            batched_ts.append(time.perf_counter() - t0)
            same &= all(r.output_ids == s for r, s in zip(reqs, serial, strict=True))
    finally:
        eng.close()
    t_serial, t_batched = statistics.median(serial_ts), statistics.median(batched_ts)
    tokens = sessions * new
    return (
        {"batched_over_serial_16": t_serial / t_batched},
        {
            "serial_tok_s": tokens / t_serial,
            "batched_tok_s": tokens / t_batched,
            "serial_s": t_serial,
            "batched_s": t_batched,
            "seeded_outputs_identical": same,
        },
    )


def bench_kv_move(model_dir: str, quick: bool) -> tuple[dict, dict]:
    ctx_len, new, repeats = 8192, 8, (3 if quick else 5)
    src = Engine(model_dir)
    dst = Engine(model_dir)
    moves, prefills, blob_bytes, same = [], [], 0, True
    try:
        dst.generate(_prompt(64, 1), {"max_new_tokens": 2})  # warm-up
        for rep in range(repeats):
            context = _prompt(ctx_len, 100 + rep)
            src.generate(context, {"max_new_tokens": 1})  # the session's context lives on src
            turn = [*context, 11, 12, 13]  # the next call: context + a short new suffix
            sp = {"max_new_tokens": new, "temperature": 1.0, "sampling_seed": rep}
            # side by side: a cold re-prefill on dst, then the KV move to dst
            dst.flush_cache()
            t0 = time.perf_counter()
            cold = dst.generate(turn, sp)
            prefills.append(time.perf_counter() - t0)
            dst.flush_cache()
            t0 = time.perf_counter()
            blob = src.export_kv(turn)
            n = dst.import_kv(blob)
            moved = dst.generate(turn, sp)
            moves.append(time.perf_counter() - t0)
            blob_bytes = len(blob)
            assert n == ctx_len and moved["meta_info"]["cached_tokens"] == ctx_len
            same &= moved["output_ids"] == cold["output_ids"]
    finally:
        src.close()
        dst.close()
    move, prefill = statistics.median(moves), statistics.median(prefills)
    return (
        {"kv_move_over_prefill_8k": move / prefill},
        {
            "kv_move_s": move,
            "reprefill_s": prefill,
            "kv_blob_mib": blob_bytes / 2**20,
            "moved_output_identical": same,
        },
    )


def bench_logprobs(model_dir: str, quick: bool) -> tuple[dict, dict]:
    from transformers import AutoModelForCausalLM

    n, new = (8, 24) if quick else (16, 64)
    prompts = [_prompt(40 + 9 * i, 500 + i) for i in range(n)]
    params = [
        [
            {"temperature": 0},
            {"temperature": 1.0},
            {"temperature": 0.7, "top_p": 0.9},
            {"temperature": 1.3, "top_k": 50},
        ][i % 4]
        | {"max_new_tokens": new, "sampling_seed": i, "ignore_eos": True}
        for i in range(n)
    ]
    eng = Engine(model_dir)
    try:
        reqs = [eng.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
        for r in reqs:
            r.done.wait()
    finally:
        eng.close()
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for p, r in zip(prompts, reqs, strict=True):
            lp = torch.log_softmax(ref(torch.tensor([p + r.output_ids])).logits[0].float(), -1)
            for i, (tok, got) in enumerate(zip(r.output_ids, r.output_logprobs, strict=True)):
                worst = max(worst, abs(lp[len(p) - 1 + i, tok].item() - got))
    return {"logprob_max_abs_diff": worst}, {"logprob_tokens_checked": n * new}


def bench_tito_bytes(model_dir: str, quick: bool) -> tuple[dict, dict]:
    """TITO bytes stored for a 200-turn session reaching 200K tokens, over unique tokens x 4 B
    (the session goes through the real TitoLog into Parquet; see bench/tito.py)."""
    import tito as tito_bench  # bench/tito.py, beside this script

    out = tito_bench.measure(200, 200_000)
    return {"tito_bytes_over_unique": out["tito_bytes_over_unique"]}, {
        "tito_naive_over_unique": out["naive_bytes_over_unique"],
        "tito_stored_bytes": out["stored_bytes"],
    }


# Each entry: fn(model_dir, quick) -> (figures, details). Append new figures here.
BENCHES = [bench_batching, bench_kv_move, bench_logprobs, bench_tito_bytes]

TARGETS = {
    "batched_over_serial_16": (">=", 4.0),
    "kv_move_over_prefill_8k": ("<=", 0.2),
    "logprob_max_abs_diff": ("<=", 1e-4),
    "tito_bytes_over_unique": ("<=", 1.1),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs, < 1 minute")
    parser.add_argument("--json", type=Path, help="write figures and details here")
    args = parser.parse_args(argv)
    figures, details = {}, {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny", seed=0)
        for bench in BENCHES:
            f, d = bench(model_dir, args.quick)
            figures.update(f)
            details.update(d)
    print(f"{'figure':<28} {'value':>12}  target")
    for key, value in figures.items():
        op, bound = TARGETS.get(key, ("", None))
        ok = "" if bound is None else ("ok" if eval(f"{value} {op} {bound}") else "MISSED")
        print(f"{key:<28} {value:>12.4g}  {op} {bound if bound is not None else ''} {ok}")
    for key, value in details.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"  {key:<26} {shown:>12}")
    print(f"total {time.perf_counter() - t0:.1f}s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"bench": "engine", "quick": args.quick, "figures": figures, "details": details}
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
