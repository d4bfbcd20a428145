"""Tree-packed vs flat training: step time side by side, and fp64 exactness.

A group of synthetic branching agent sessions (retries, rollbacks, context
resets, duplicate calls, tool spans) becomes training samples twice from the same
trees and rewards: tree layout (each unique token once, ``Trainer``'s path) and
flat layout (one causal sequence per branch, the baseline). Both compute the
PPO-clip loss and gradients of a small Qwen3-architecture model; the step time
is the median over interleaved repeats. Target: tree time <= 1.25 x (unique /
flat tokens) x flat time, i.e. tree compute per trained token no worse than
1.25 x flat. Exactness: the same comparison in float64 on a tiny model, for
PPO-clip and GRPO: max |loss diff| and max |grad diff| (target <= 1e-12).

    python bench/tree_train.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import AutoModelForCausalLM, Qwen3Config

from tasks.train.trainer import (
    LossConfig,
    flat_loss_and_grads,
    keep_norms_in_fp64,
    tree_loss_and_grads,
)
from tasks.trajectory.sampler import build_samples
from tasks.trajectory.synth import random_session
from tasks.trajectory.tree import build_trees


def make_model(vocab: int, hidden: int, layers: int, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=16384,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype)
    if dtype == torch.float64:
        keep_norms_in_fp64(model)
    return model


def workload(n_sessions: int, n_calls: int, vocab: int, scale: int, seed: int = 0):
    recs, spans = [], {}
    for i in range(n_sessions):
        r, sp = random_session(
            np.random.default_rng(seed + i),
            n_calls=n_calls,
            session_id=f"s{i}",
            vocab=vocab,
            sys_len=2 * scale,
            new_len=(scale // 4, 3 * scale // 2),
            out_len=(scale // 4, 3 * scale // 2),
            p_retry=0.25,
            p_reset=0.1,
            p_dup=0.05,
            p_tool=0.3,
        )
        recs += r
        spans.update(sp)
    trees = build_trees(recs, spans=spans)
    rewards = {f"s{i}": i / max(1, n_sessions - 1) for i in range(n_sessions)}
    groups = dict.fromkeys(rewards, "g")
    tree = build_samples(trees, rewards, groups)
    flat = build_samples(trees, rewards, groups, layout="flat")
    return tree, flat


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def exactness(tree, flat, vocab: int, max_tokens: int) -> tuple[float, float]:
    """Max |loss diff| and max |grad diff| tree vs flat, float64, PPO-clip and GRPO."""
    model = make_model(vocab, 32, 2, torch.float64, seed=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    norm = float(sum(s.n_flat_trainable for s in tree))
    dl = dg = 0.0
    for cfg in (LossConfig("ppo_clip", 0.2, 0.28), LossConfig("grpo", 0.2, 0.2)):
        model.zero_grad(set_to_none=True)
        t = tree_loss_and_grads(model, tree, cfg=cfg, normalizer=norm, max_tokens=max_tokens)
        tg = grads(model)
        model.zero_grad(set_to_none=True)
        model.set_attn_implementation("sdpa")
        f = flat_loss_and_grads(model, flat, cfg=cfg, normalizer=norm)
        fg = grads(model)
        dl = max(dl, abs(t["loss"] - f["loss"]))
        dg = max(dg, max(float((tg[k] - fg[k]).abs().max()) for k in tg))
    return dl, dg


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model and workload (< 1 min)")
    ap.add_argument("--sessions", type=int, default=None)
    ap.add_argument("--calls", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--scale", type=int, default=None, help="typical tokens per turn")
    ap.add_argument("--max-tokens", type=int, default=4096, help="max_tokens_per_micro")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--dense", action="store_true", help="also time the dense 4D-mask path")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: least sensitive to other load)"
    )
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    q = args.quick
    sessions = args.sessions or (3 if q else 4)
    calls = args.calls or (8 if q else 14)
    hidden = args.hidden or (128 if q else 256)
    layers = args.layers or (2 if q else 4)
    scale = args.scale or (32 if q else 64)
    repeats = args.repeats or 5
    vocab = 2048

    tree, flat = workload(sessions, calls, vocab, scale)
    unique = sum(s.n_tokens for s in tree)
    n_flat = sum(s.n_tokens for s in flat)
    ratio = unique / n_flat
    model = make_model(vocab, hidden, layers, torch.float32)
    cfg = LossConfig("ppo_clip", 0.2, 0.28)
    norm = float(sum(s.n_flat_trainable for s in tree))

    def run_tree(attention: str) -> float:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        tree_loss_and_grads(
            model, tree, cfg=cfg, normalizer=norm, max_tokens=args.max_tokens, attention=attention
        )
        return time.perf_counter() - t0

    def run_flat() -> float:
        model.zero_grad(set_to_none=True)
        model.set_attn_implementation("sdpa")
        t0 = time.perf_counter()
        flat_loss_and_grads(model, flat, cfg=cfg, normalizer=norm)
        return time.perf_counter() - t0

    run_tree("tree"), run_flat()  # warm-up
    tt, ft, dt = [], [], []
    for _ in range(repeats):  # interleaved, so load changes hit both sides
        tt.append(run_tree("tree"))
        ft.append(run_flat())
        if args.dense:
            dt.append(run_tree("dense"))
    t_tree, t_flat = statistics.median(tt), statistics.median(ft)
    dl, dg = exactness(tree, flat, vocab, args.max_tokens)
    res = {
        "sessions": float(sessions),
        "branches": float(len(flat)),
        "unique_tokens": float(unique),
        "flat_tokens": float(n_flat),
        "unique_over_flat_tokens": ratio,
        "unique_over_flat_trainable": sum(s.n_trainable for s in tree) / norm,
        "tree_step_s": t_tree,
        "flat_step_s": t_flat,
        "tree_over_flat_step_time": t_tree / t_flat,
        "tree_over_flat_step_time_target": 1.25 * ratio,
        "loss_max_abs_diff_fp64": dl,
        "grad_max_abs_diff_fp64": dg,
        "torch_threads": float(torch.get_num_threads()),
    }
    if dt:
        res["dense_tree_over_flat_step_time"] = statistics.median(dt) / t_flat
    print(f"{'metric':<36}{'value':>16}")
    for k, v in res.items():
        print(f"{k:<36}{v:>16.6g}")
    ok_t = res["tree_over_flat_step_time"] <= res["tree_over_flat_step_time_target"]
    ok_x = dl <= 1e-12 and dg <= 1e-12
    print(
        f"step time tree/flat {res['tree_over_flat_step_time']:.3f} vs target "
        f"{res['tree_over_flat_step_time_target']:.3f}: {'OK' if ok_t else 'MISSED'}; "
        f"fp64 exactness: {'OK' if ok_x else 'MISSED'}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "tree_train", "quick": q, **res}, f, indent=2)
    return res


if __name__ == "__main__":
    main()
