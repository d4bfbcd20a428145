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

    python bench/tree_train.py [--quick] [--json PATH] [--model smollm2|PATH]

``--model`` (a pretrained name, e.g. ``smollm2``, or a local HF checkpoint directory):
the same tree-vs-flat step time on that model's weights through a real ``Trainer``
(fp32, its vocabulary), the fp32 tree/flat loss and grad agreement, training tokens per
second of full ``Trainer.step``s, where a step's time goes (forward, backward,
optimizer) and the process's peak RSS (`bench_model`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from contextlib import contextmanager

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


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (Linux: ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@contextmanager
def step_profile(trainer, into: dict[str, float]):
    """Time a `Trainer.step`'s parts into ``into`` (seconds, summed): ``forward`` (the
    decoder and LM head forwards, hooks on the model), ``backward`` (``Tensor.backward``)
    and ``optimizer`` (``optimizer.step``); the rest of the step (packing, the loss terms,
    grad clipping) is ``step - forward - backward - optimizer``."""
    model, opt = trainer.model, trainer.optimizer
    starts: list[float] = []

    def pre(_m, _a):
        starts.append(time.perf_counter())

    def post(_m, _a, _o):
        into["forward"] = into.get("forward", 0.0) + time.perf_counter() - starts.pop()

    def timed(key, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                into[key] = into.get(key, 0.0) + time.perf_counter() - t0

        return wrapper

    hooks = [m.register_forward_pre_hook(pre) for m in (model.get_decoder(), model.lm_head)] + [
        m.register_forward_hook(post) for m in (model.get_decoder(), model.lm_head)
    ]
    backward, opt_step = torch.Tensor.backward, opt.step
    torch.Tensor.backward = timed("backward", backward)
    opt.step = timed("optimizer", opt_step)
    try:
        yield into
    finally:
        torch.Tensor.backward = backward
        opt.step = opt_step
        for h in hooks:
            h.remove()


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def bench_model(
    model_dir: str,
    quick: bool,
    *,
    sessions: int | None = None,
    calls: int | None = None,
    scale: int | None = None,
    repeats: int | None = None,
    steps: int | None = None,
    max_tokens: int = 4096,
    threads: int = 1,
) -> tuple[dict, dict]:
    """Tree vs flat step time on a pretrained checkpoint (fp32, a real `Trainer`'s model),
    interleaved, medians; then full `Trainer.step`s on the tree samples, profiled. Returns
    ``(figures, details)`` as bench/engine.py's `BENCHES` entries do."""
    from tasks.train.trainer import Trainer

    torch.set_num_threads(threads)
    sessions = sessions or 2  # two rewards: a group with an advantage
    calls = calls or (3 if quick else 6)
    scale = scale or (12 if quick else 32)
    repeats = repeats or (1 if quick else 3)
    steps = steps or (1 if quick else 2)
    trainer = Trainer(model_dir, lr=1e-6, max_tokens_per_micro=max_tokens)
    model = trainer.model
    vocab = model.config.get_text_config(decoder=True).vocab_size
    tree, flat = workload(sessions, calls, vocab, scale)
    unique = sum(s.n_tokens for s in tree)
    n_flat = sum(s.n_tokens for s in flat)
    ratio = unique / n_flat
    cfg = trainer.loss_cfg
    norm = float(sum(s.n_flat_trainable for s in tree))
    got: dict[str, tuple[float, dict]] = {}

    def run(layout: str) -> float:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if layout == "tree":
            m = tree_loss_and_grads(model, tree, cfg=cfg, normalizer=norm, max_tokens=max_tokens)
        else:
            m = flat_loss_and_grads(model, flat, cfg=cfg, normalizer=norm)
        dt = time.perf_counter() - t0
        if layout not in got:
            got[layout] = (m["loss"], grads(model))
        return dt

    run("tree"), run("flat")  # warm-up; keeps the loss and grads of each layout
    tt, ft = [], []
    for _ in range(repeats):  # interleaved, so load changes hit both sides
        tt.append(run("tree"))
        ft.append(run("flat"))
    (lt, gt), (lf, gf) = got["tree"], got["flat"]
    grad_rel = max(_rel_diff(gt[k], gf[k]) for k in gf)
    got.clear()
    del gt, gf
    model.zero_grad(set_to_none=True)
    prof: dict[str, float] = {}
    step_s = []
    with step_profile(trainer, prof):
        for _ in range(steps):
            step_s.append(trainer.step(tree)["train/step_time_s"])
    total = sum(step_s)
    t_tree, t_flat = statistics.median(tt), statistics.median(ft)
    figures = {"tree_over_flat_step_time": t_tree / t_flat}
    details = {
        "train_unique_tokens": float(unique),
        "train_flat_tokens": float(n_flat),
        "unique_over_flat_tokens": ratio,
        "tree_over_flat_step_time_target": 1.25 * ratio,
        "tree_loss_grads_s": t_tree,
        "flat_loss_grads_s": t_flat,
        "tree_flat_loss_rel_diff_fp32": abs(lt - lf) / max(abs(lf), 1e-30),
        "tree_flat_grad_rel_diff_fp32": grad_rel,
        "train_step_s": total / len(step_s),
        "train_tok_s": unique * len(step_s) / total,
        "train_flat_tok_s": n_flat * len(step_s) / total,
        "train_forward_frac": prof.get("forward", 0.0) / total,
        "train_backward_frac": prof.get("backward", 0.0) / total,
        "train_optimizer_frac": prof.get("optimizer", 0.0) / total,
        "train_other_frac": 1 - sum(prof.values()) / total,
        "trainer_peak_rss_mib": peak_rss_mib(),
        "train_torch_threads": float(torch.get_num_threads()),
    }
    return figures, details


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
    ap.add_argument(
        "--model",
        default=None,
        help="a pretrained model (smollm2) or a local HF checkpoint: its tree-vs-flat step "
        "time, training tokens/s, step profile and peak RSS (see bench_model)",
    )
    args = ap.parse_args(argv)
    if args.model:
        return _main_model(args)
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


def _main_model(args) -> dict[str, float]:
    import engine as engine_bench  # bench/engine.py, beside this script

    model_dir, prefix = engine_bench.resolve_model(args.model)
    figures, details = bench_model(
        model_dir,
        args.quick,
        sessions=args.sessions,
        calls=args.calls,
        scale=args.scale,
        repeats=args.repeats,
        max_tokens=args.max_tokens,
        threads=args.threads,
    )
    res = {f"{prefix}{k}": v for k, v in figures.items()} | details
    print(f"{'metric':<36}{'value':>16}")
    for k, v in res.items():
        print(f"{k:<36}{v:>16.6g}")
    ratio, target = figures["tree_over_flat_step_time"], details["tree_over_flat_step_time_target"]
    print(
        f"step time tree/flat {ratio:.3f} vs target {target:.3f}: {'OK' if ratio <= target else 'MISSED'}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"bench": "tree_train", "model": model_dir, "quick": args.quick, **res}, f, indent=2
            )
    return res


if __name__ == "__main__":
    main()
