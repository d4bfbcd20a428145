"""Embedded engine benchmark: batching, KV migration, logprob exactness (side by side, ratios).

    python bench/engine.py [--quick] [--json PATH] [--model smollm2|PATH]

Figures (issue 3 targets):
- ``batched_over_serial_16``: throughput of 16 concurrent sessions over serving the same 16
  one by one (target >= 4); median of alternated runs.
- ``kv_move_over_prefill_8k``: time to move an 8K-token context's KV to another engine
  (export + import + a short generate) over a re-prefill of it there (the same short
  generate on a cold cache); median over repeats, alternated (target <= 0.2).
- ``logprob_max_abs_diff``: max |engine logprob - full-forward recompute| over every output
  token of a batched, mixed-sampling run (fp32; target <= 1e-4). The recompute is of the
  distribution the engine drew from (temperature, top-k, top-p; greedy: raw), as the
  trainer scores it (tasks/train/logprobs.py): a raw ``log_softmax`` only agrees where the
  logits are near-flat (the tiny random model), not on a real model.

Each figure comes from a function in `BENCHES` returning ``(figures, details)``; another
figure (e.g. ``tito_bytes_over_unique``) is one more function appended there.

``--model`` (a pretrained name, ``smollm2``, prepared on first use as ``gyre model prepare
smollm2`` does, or a local HF checkpoint directory) runs `MODEL_BENCHES` on that model
instead of the tiny one, each in its own process (so that its peak RSS is its own), the
figures prefixed (``smol_`` for SmolLM2, issue 16):
- ``smol_batched_over_serial_16``: the engine at 16 concurrent sessions over serial HF
  ``generate`` of the same 16 (the baseline a user has without gyre; target >= 4); the
  engine serving them one by one is timed alongside (detail). Also rollout tokens/s, where
  the engine's time goes (prefill, decode forward, sampling, the rest) and the engine
  process's peak RSS (taken before the HF baseline model is loaded into it).
- ``smol_logprob_max_abs_diff``: as above, on the real weights (fp32; target <= 1e-4).
- ``smol_tree_over_flat_step_time``: bench/tree_train.py's `bench_model` (tree-packed over
  flat loss+grads time on the real model; target <= 1.25 x unique/flat tokens), with
  training tokens/s, a step's forward/backward/optimizer split and the trainer's peak RSS.
One torch thread everywhere (the engine's default; HF ``generate`` and the trainer too), so
that the ratios compare the same compute on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from infra.engine import pretrained
from infra.engine.engine import Engine
from infra.engine.tiny_model import make_tiny_model


class ModelError(SystemExit):
    """``--model`` names nothing usable: the message says what to do (exit status 2)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = 2


def resolve_model(name: str) -> tuple[str, str]:
    """``(checkpoint dir, figure prefix)`` of ``--model``: a pretrained name (``smollm2``:
    prepared on first use through `pretrained.prepare`, as ``gyre model prepare smollm2``)
    or a local HF checkpoint directory (prefix ``model_``)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"--model {name}: {path} has no config.json (not an HF checkpoint)")
        smol = path.resolve() == pretrained.model_dir(pretrained.SMOLLM2.name).resolve()
        return str(path), "smol_" if smol else "model_"
    try:
        m = pretrained.lookup(name)
    except pretrained.PretrainedError as exc:
        raise ModelError(f"--model {name}: not a directory, and {exc}") from None
    if (why := pretrained.problem(m.name)) is not None:
        raise ModelError(
            f"--model {name}: the model is not prepared and cannot be here: {why}. "
            f"Then run `gyre model prepare {name}`."
        )
    if not pretrained.is_complete(pretrained.model_dir(m.name)):
        print(f"preparing {m.name} (once; as `gyre model prepare {name}`)", file=sys.stderr)
    prefix = "smol_" if m.name == pretrained.SMOLLM2.name else f"{m.name.split('-')[0]}_"
    return pretrained.prepare(m.name, say=lambda msg: print(msg, file=sys.stderr)), prefix


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (Linux: ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@contextmanager
def engine_profile(eng: Engine, into: dict[str, float]):
    """Sum the engine scheduler's time into ``into`` (seconds): ``prefill`` (prefill
    forwards, batched or not), ``decode`` (batched decode forwards) and ``sampling`` (`Engine._choose`);
    the rest of a run's wall time is scheduling and bookkeeping."""
    forward, choose = eng._forward, eng._choose

    def timed_forward(input_ids, position_ids, cache, attention_mask=None):
        t0 = time.perf_counter()
        try:
            return forward(input_ids, position_ids, cache, attention_mask)
        finally:  # a decode step is one token a row; a prefill (one prompt or several) more
            one = attention_mask is not None and input_ids.shape[1] == 1
            key = "decode" if one else "prefill"
            into[key] = into.get(key, 0.0) + time.perf_counter() - t0

    def timed_choose(logits, reqs):
        t0 = time.perf_counter()
        try:
            return choose(logits, reqs)
        finally:
            into["sampling"] = into.get("sampling", 0.0) + time.perf_counter() - t0

    eng._forward, eng._choose = timed_forward, timed_choose
    try:
        yield into
    finally:
        del eng._forward, eng._choose  # back to the class's methods


def _prompt(n: int, salt: int) -> list[int]:
    return [(salt * 7919 + 31 * i + (i * i) % 97) % 1000 + 5 for i in range(n)]


def _hf_generate(model, prompt: list[int], sp: dict) -> list[int]:
    """Serial HF ``generate`` with the same sampling as the engine (temperature, full
    vocabulary, no EOS stop), seeded per request."""
    torch.manual_seed(sp["sampling_seed"])
    n = sp["max_new_tokens"]
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=True,
            temperature=sp["temperature"],
            top_k=0,
            top_p=1.0,
        )
    return out[0, len(prompt) :].tolist()


def bench_batching(model_dir: str, quick: bool, *, hf_baseline: bool = False) -> tuple[dict, dict]:
    """16 sessions served concurrently vs one by one, alternated, medians. ``hf_baseline``:
    the figure's serial side is HF ``generate`` (a pretrained model: what a user has
    without gyre), the engine's own serial serving a detail."""
    sessions = 16
    # the full run's shape is the tiny model's (128-token prompts, 96 new tokens); a quick
    # run on a real model is prefill-bound (shorter, for time), not a figure
    if hf_baseline and quick:
        prompt_len, new, repeats = 32, 8, 1
    else:
        prompt_len, new, repeats = 128, (32 if quick else 96), (1 if quick else 3)
    prompts = [_prompt(prompt_len, s) for s in range(sessions)]
    params = [
        {"max_new_tokens": new, "temperature": 0.8, "sampling_seed": s, "ignore_eos": True}
        for s in range(sessions)
    ]
    if hf_baseline:
        torch.set_num_threads(1)  # HF generate's thread count: the engine's scheduler uses 1
    eng = Engine(model_dir, max_batch_size=sessions)
    serial_ts, batched_ts, hf_ts, same, hf_len_ok = [], [], [], True, True
    prof: dict[str, float] = {}
    hf = None

    def batched():
        eng.flush_cache()
        t0 = time.perf_counter()
        reqs = [eng.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
        for r in reqs:
            r.done.wait()
        return time.perf_counter() - t0, reqs

    try:
        eng.generate(prompts[0], {"max_new_tokens": 4})  # warm-up
        details: dict = {}
        if hf_baseline:
            from transformers import AutoModelForCausalLM

            batched()  # the engine at its working size, before the HF model joins the process
            details["engine_peak_rss_mib"] = peak_rss_mib()
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            _hf_generate(hf, prompts[0][:8], params[0] | {"max_new_tokens": 2})  # warm-up
        for _ in range(repeats):  # side by side, alternating
            if hf is not None:
                t0 = time.perf_counter()
                outs = [_hf_generate(hf, p, sp) for p, sp in zip(prompts, params, strict=True)]
                hf_ts.append(time.perf_counter() - t0)
                hf_len_ok &= all(len(o) == new for o in outs)
            eng.flush_cache()
            t0 = time.perf_counter()
            serial = [
                eng.generate(p, sp)["output_ids"] for p, sp in zip(prompts, params, strict=True)
            ]
            serial_ts.append(time.perf_counter() - t0)
            with engine_profile(eng, prof):
                t, reqs = batched()
            batched_ts.append(t)
            same &= all(r.output_ids == s for r, s in zip(reqs, serial, strict=True))
    finally:
        eng.close()
    t_serial, t_batched = statistics.median(serial_ts), statistics.median(batched_ts)
    tokens = sessions * new
    details |= {
        "serial_tok_s": tokens / t_serial,
        "batched_tok_s": tokens / t_batched,
        "serial_s": t_serial,
        "batched_s": t_batched,
        "seeded_outputs_identical": same,
    }
    if not hf_baseline:
        return {"batched_over_serial_16": t_serial / t_batched}, details
    t_hf = statistics.median(hf_ts)
    wall = sum(batched_ts)
    details = {
        "hf_serial_tok_s": tokens / t_hf,
        "hf_serial_s": t_hf,
        "engine_serial_over_hf_serial": t_hf / t_serial,
        "hf_outputs_full_length": hf_len_ok,
        "rollout_prompt_tokens": float(prompt_len),
        "rollout_new_tokens": float(new),
        **details,
        "rollout_prefill_tok_s": sessions * prompt_len * repeats / prof.get("prefill", 1e-9),
        "rollout_decode_forward_tok_s": tokens * repeats / prof.get("decode", 1e-9),
        "rollout_prefill_frac": prof.get("prefill", 0.0) / wall,
        "rollout_decode_frac": prof.get("decode", 0.0) / wall,
        "rollout_sampling_frac": prof.get("sampling", 0.0) / wall,
        "rollout_other_frac": 1 - sum(prof.values()) / wall,
        "engine_plus_hf_peak_rss_mib": peak_rss_mib(),
    }
    return {"batched_over_serial_16": t_hf / t_batched}, details


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

    from tasks.train.logprobs import SamplingDist, token_logprobs

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
        for p, sp, r in zip(prompts, params, reqs, strict=True):
            # the engine reports the logprob under the distribution it drew from (temperature,
            # top-k, top-p; greedy: raw): the trainer's recompute of it (tasks/train/logprobs)
            dist = SamplingDist(sp["temperature"] or 1.0, sp.get("top_p", 1.0), sp.get("top_k", -1))
            logits = ref(torch.tensor([p + r.output_ids])).logits[0, len(p) - 1 : -1].float()
            lp, _ = token_logprobs(logits, torch.tensor(r.output_ids), dist)
            got = torch.tensor(r.output_logprobs, dtype=lp.dtype)
            worst = max(worst, float((lp - got).abs().max()))
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


def bench_train(model_dir: str, quick: bool) -> tuple[dict, dict]:
    """Tree vs flat training step time on the model, training tokens/s, profile, trainer RSS
    (bench/tree_train.py's `bench_model`)."""
    import tree_train  # bench/tree_train.py, beside this script

    return tree_train.bench_model(model_dir, quick)


# Each entry: fn(model_dir, quick) -> (figures, details). Append new figures here.
BENCHES = [bench_batching, bench_kv_move, bench_logprobs, bench_tito_bytes]
# The same on a pretrained checkpoint (--model): the batching baseline is HF generate.
MODEL_BENCHES = [partial(bench_batching, hf_baseline=True), bench_logprobs, bench_train]

TARGETS = {
    "batched_over_serial_16": (">=", 4.0),
    "kv_move_over_prefill_8k": ("<=", 0.2),
    "logprob_max_abs_diff": ("<=", 1e-4),
    "tito_bytes_over_unique": ("<=", 1.1),
    "tree_over_flat_step_time": ("<=", None),  # 1.25 x unique/flat tokens, set per run
}


def _in_process(bench, model_dir: str, quick: bool) -> tuple[dict, dict]:
    """``bench(model_dir, quick)`` in a fresh process, so that its peak RSS is its own."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(bench, model_dir, quick).result()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs, < 1 minute")
    parser.add_argument("--json", type=Path, help="write figures and details here")
    parser.add_argument(
        "--model",
        help="a pretrained model (smollm2; prepared on first use) or a local HF checkpoint "
        "directory: MODEL_BENCHES on it, figures prefixed (smol_ for smollm2)",
    )
    args = parser.parse_args(argv)
    figures, details = {}, {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model_dir, prefix = resolve_model(args.model)
            for bench in MODEL_BENCHES:
                f, d = _in_process(bench, model_dir, args.quick)
                figures.update(f)
                details.update(d)
        else:
            model_dir, prefix = make_tiny_model(Path(tmp) / "tiny", seed=0), ""
            for bench in BENCHES:
                f, d = bench(model_dir, args.quick)
                figures.update(f)
                details.update(d)
    targets = dict(TARGETS)
    if "unique_over_flat_tokens" in details:
        targets["tree_over_flat_step_time"] = ("<=", 1.25 * details["unique_over_flat_tokens"])
    figures = {f"{prefix}{k}": v for k, v in figures.items()}
    targets = {f"{prefix}{k}": v for k, v in targets.items()}
    print(f"{'figure':<34} {'value':>12}  target")
    for key, value in figures.items():
        op, bound = targets.get(key, ("", None))
        ok = "" if bound is None else ("ok" if eval(f"{value} {op} {bound}") else "MISSED")
        shown = "" if bound is None else f"{bound:.4g}"
        print(f"{key:<34} {value:>12.4g}  {op} {shown} {ok}")
    for key, value in details.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"  {key:<32} {shown:>12}")
    print(f"total {time.perf_counter() - t0:.1f}s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"bench": "engine", "quick": args.quick}
        if args.model:  # the issue's figures as top-level keys, then the same grouped
            payload |= {"model": args.model, "model_dir": model_dir, **figures}
        payload |= {"figures": figures, "details": details}
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
