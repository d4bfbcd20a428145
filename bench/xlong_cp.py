"""Context parallel on one long path: k members vs 1 (gloo, spawned processes, CPU).

    python bench/xlong_cp.py [--quick] [--json PATH]

One path of ``n`` tokens of the micro Qwen3 model (tests/models.py shape) is trained by
k = 1 and k = 2 members (tasks/train/context_parallel.py). Reports the fp32 gradient
agreement (``xlong_cp_grad_max_rel_diff``: max over parameters of max|g_k - g_1| /
max|g_1|, target <= 1e-5) and, per member, the step time and the peak RSS growth of the
step (ru_maxrss after the step minus before it): what CP buys is each member's share of
the activations and attention work.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 256


def _member(rank: int, world: int, store_path: str, n: int, out) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from tasks.train import context_parallel as cp
    from tests.models import micro_config

    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world
        )
        rng = np.random.default_rng(0)
        ids = rng.integers(0, VOCAB, n)
        parent = np.arange(n) - 1  # one path
        depth = np.arange(n)
        sel = np.arange(1, n)
        w = rng.normal(size=len(sel))
        torch.manual_seed(0)
        cfg = micro_config("qwen3", VOCAB)
        cfg.max_position_embeddings = max(n, 512)
        model = AutoModelForCausalLM.from_config(cfg)
        dist.barrier()
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        logp, _, mine = cp.member_logprobs(model, ids, depth, parent, sel)
        loss = -(torch.as_tensor(w[mine], dtype=logp.dtype) * logp).sum() / len(sel)
        loss.backward()
        seconds = time.perf_counter() - t0
        rss_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
        grads = {}
        for k, p in model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            grads[k] = g.numpy().copy()
        stats = torch.tensor([seconds, rss_mb], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        if rank == 0:
            out.put((float(stats[0]), float(stats[1]), grads))
        dist.destroy_process_group()
    except BaseException:
        out.put(("error", traceback.format_exc(), None))


def _run(world: int, n: int) -> tuple[float, float, dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        store = str(Path(d) / "store")
        procs = [ctx.Process(target=_member, args=(r, world, store, n, q)) for r in range(world)]
        for p in procs:
            p.start()
        res = q.get(timeout=1800)
        for p in procs:
            p.join(timeout=60)
    if res[0] == "error":
        raise RuntimeError(res[1])
    return res


def measure(quick: bool) -> dict:
    n = 1024 if quick else 8192
    s1, m1, g1 = _run(1, n)
    s2, m2, g2 = _run(2, n)
    rel = max(float(np.abs(g2[k] - g).max() / max(np.abs(g).max(), 1e-30)) for k, g in g1.items())
    return {
        "xlong_cp_path_tokens": n,
        "xlong_cp_grad_max_rel_diff": rel,
        "xlong_cp_step_s_k1": s1,
        "xlong_cp_step_s_k2": s2,
        "xlong_cp_member_peak_mb_k1": m1,
        "xlong_cp_member_peak_mb_k2": m2,
        "xlong_cp_member_time_ratio_k2_over_k1": s2 / s1,
        "xlong_cp_member_mem_ratio_k2_over_k1": m2 / m1 if m1 > 0 else float("nan"),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 1K-token path (seconds)")
    ap.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = ap.parse_args(argv)
    out = measure(args.quick)
    print(f"{'metric':<42}{'value':>14}")
    for k, v in out.items():
        print(f"{k:<42}{v:>14.4g}" if isinstance(v, float) else f"{k:<42}{v:>14}")
    ok = out["xlong_cp_grad_max_rel_diff"] <= 1e-5
    print(f"target grad rel diff <= 1e-5: {'met' if ok else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
