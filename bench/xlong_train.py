"""One training step on ONE path of n tokens, chunked (tasks/train/chunked.py).

Each size runs in a fresh subprocess (peak RSS per size from ``resource.getrusage``): the
real Trainer path (``Trainer.step`` on one Sample, ``max_tokens_per_micro`` = the chunk) on
the tiny model with ``max_position_embeddings`` large enough. Reports peak RSS and its slope
(bytes per token), step time per 1K tokens growth against what attention FLOPs predict, the
achieved attention FLOP/s against torch.mm's fp32 FLOP/s measured in the same run, the fp64
chunked-vs-unchunked gradient difference on a random tree, and what 1M tokens would cost.

``python -m bench.xlong_train [--quick] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# the repository root: the fp64 figure reuses tests/tasks/train/test_chunked.py's tree and model
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FULL = [4096, 16384, 32768, 65536, 131072]
QUICK = [1024, 2048, 4096, 8192]
CHUNK = 4096
STEP_BUDGET_S = 300.0  # stop growing once one step takes longer than this


def _child(n: int, chunk: int) -> dict:
    import torch

    from infra.engine.tiny_model import make_tiny_model
    from tasks.train.trainer import Trainer
    from tasks.trajectory.sampler import Sample

    torch.manual_seed(0)
    model_dir = make_tiny_model(max_position_embeddings=max(32768, 1 << (n - 1).bit_length()))
    tr = Trainer(model_dir, max_tokens_per_micro=chunk)
    cfg = tr.model.config
    rng = np.random.default_rng(0)
    z = np.zeros(n)
    sample = Sample(
        run_id="b",
        sample_id="s",
        session_id="s",
        group_id="g",
        step=0,
        token_ids=rng.integers(0, cfg.vocab_size, n).astype(np.int32),
        parent_idx=(np.arange(n) - 1).astype(np.int32),
        positions=np.arange(n, dtype=np.int32),
        weight_pos=np.ones(n),
        weight_neg=z,
        behaviour_logprobs=np.full(n, -np.log(cfg.vocab_size)),
        versions=np.zeros(n, np.int64),
        n_tokens=n,
        n_trainable=n - 1,
        n_flat_tokens=n,
        reward=1.0,
        n_flat_trainable=n - 1,
        counts=np.ones(n, np.int32),
    )
    t0 = time.perf_counter()
    tr.step([sample], current_version=0)
    dt = time.perf_counter() - t0
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    # causal QK^T and PV: 2 matmuls x 2 FLOP x n^2/2, per head and layer; the step runs the
    # forward twice (checkpoint recompute) and a backward of ~2 forwards
    attn_fwd = 2.0 * n * n * cfg.num_attention_heads * head_dim * cfg.num_hidden_layers
    return {
        "n": n,
        "step_s": dt,
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "attn_flops": 4.0 * attn_fwd,
    }


def _matmul_flops() -> float:
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    t0 = time.perf_counter()
    for _ in range(5):
        torch.mm(a, b)
    return 5 * 2 * 2048**3 / (time.perf_counter() - t0)


def _grad_diff_fp64() -> float:
    """Chunked vs one-forward loss/grads on a random tree, fp64 (max abs diff)."""

    from tasks.train.chunked import chunked_token_stats
    from tasks.train.packed_loss import packed_token_stats
    from tests.tasks.train.test_chunked import _grads, _model, _tree

    model = _model(0)
    p = _tree(np.random.default_rng(1), 120)
    sel = np.flatnonzero(p.parent_idx >= 0)
    l0, g0 = _grads(model, lambda: packed_token_stats(model, p, sel, entropy=True))
    l1, g1 = _grads(
        model,
        lambda: chunked_token_stats(
            model, p.token_ids, p.positions, p.parent_idx, sel, 16, entropy=True
        ),
    )
    return max([abs(float(l0 - l1))] + [float((g0[k] - g1[k]).abs().max()) for k in g0])


def measure(quick: bool) -> dict:
    sizes = QUICK if quick else FULL
    chunk = 1024 if quick else CHUNK
    peak = _matmul_flops()
    curve = []
    for n in sizes:
        cmd = [sys.executable, "-m", "bench.xlong_train", "--child", str(n), str(chunk)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        row["attn_flops_per_s"] = row["attn_flops"] / row["step_s"]
        curve.append(row)
        if row["step_s"] > STEP_BUDGET_S:
            break
    ns = np.array([r["n"] for r in curve], float)
    mb = np.array([r["peak_mb"] for r in curve])
    slope = float(np.polyfit(ns, mb * 2**20, 1)[0]) if len(ns) > 1 else float("nan")
    first, last = curve[0], curve[-1]
    growth = (last["step_s"] / last["n"]) / (first["step_s"] / first["n"])
    by_128k = {r["n"]: r for r in curve}.get(131072)
    # 1M tokens from the attention FLOPs (n^2): at the rate the largest size reached, and at
    # this machine's matmul peak (a polynomial fitted on small sizes, where the step is not
    # yet attention-bound, underestimates it many times over)
    flops_1m = last["attn_flops"] * (2**20 / last["n"]) ** 2
    return {
        "xlong_train_path_tokens_max": int(last["n"]),
        "xlong_train_peak_mb_128k": by_128k["peak_mb"] if by_128k else None,
        "xlong_train_bytes_per_token": slope,
        "xlong_train_s_per_ktoken_last_over_first": growth,
        "xlong_train_s_per_ktoken_128k_over_4k": growth if by_128k and first["n"] == 4096 else None,
        "xlong_train_attention_predicts_growth": last["n"] / first["n"],
        "xlong_attention_flops_fraction": last["attn_flops_per_s"] / peak,
        "xlong_matmul_flops_per_s": peak,
        "xlong_chunked_grad_max_abs_diff_fp64": _grad_diff_fp64(),
        "xlong_train_1m_step_s_extrapolated": flops_1m / last["attn_flops_per_s"],
        "xlong_train_1m_step_s_at_matmul_peak": flops_1m / peak,
        "xlong_train_1m_peak_mb_extrapolated": float(mb[-1] + slope * (2**20 - ns[-1]) / 2**20),
        "chunk": chunk,
        "curve": curve,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(*a.child)))
        return
    res = measure(a.quick)
    print(f"{'tokens':>8} {'step s':>9} {'peak MB':>9} {'attn GFLOP/s':>13}")
    for r in res["curve"]:
        print(
            f"{r['n']:>8} {r['step_s']:>9.2f} {r['peak_mb']:>9.0f} {r['attn_flops_per_s'] / 1e9:>13.2f}"
        )
    for k, v in res.items():
        if k != "curve":
            print(f"{k}: {v}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
