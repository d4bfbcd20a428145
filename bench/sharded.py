"""Sharded training (FSDP2 + DCP, tasks/train/sharded.py) against replicated DP, side by side.

Real processes on gloo (forked from one server that imported torch once), the run's tiny
Qwen3 model (infra/engine/tiny_model.py; ``--model smollm2`` or a local HF checkpoint for
a pretrained one) and synthetic branching sessions as the batch. Figures (top-level keys):

- ``sharded_state_bytes_per_member_over_replica_k{1,2,4}``: the largest member's training
  state at rest after a step (weight shards + AdamW moments) over one replica's (the main
  key without suffix is k = 2; ~1/k expected). At rest only: during a step each member
  also holds the gathered weights and gradients (see the module's note).
- ``sharded_grad_max_rel_diff``: 2 sharded members vs 1 replica, fp32: the largest per-tensor
  ``max|g - g_ref| / max|g_ref|`` of the clipped gradients AdamW receives.
- ``sharded_regroup_s``: a membership change 2 -> 3 -> 1: the committed state saved with DCP,
  every new member's fresh trainer sharded and its shards loaded, and the first step, summed
  over both changes (slowest member each time); ``_save_s``, ``_load_s``, ``_step_s`` parts.
- ``sharded_step_over_replicated``: step time at k = 2, sharded / replicated DP (median of
  interleaved steps; the replicated step sums gradients with ``dp.DPGroup.reduce_grads``).

    python bench/sharded.py [--quick] [--json PATH] [--model smollm2|PATH] [--parts step]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tasks.train import dp, sharded

PRELOAD = ["tasks.train.sharded", "tasks.trajectory.synth", "tasks.trajectory.tree"]


def batch(seed: int, n: int, vocab: int, n_calls: int):
    from tasks.trajectory.sampler import build_samples
    from tasks.trajectory.synth import random_session
    from tasks.trajectory.tree import build_trees

    rng = np.random.default_rng(seed)
    recs, spans = [], {}
    for i in range(n):
        r, sp = random_session(rng, n_calls=n_calls, vocab=vocab, session_id=f"b{seed}s{i}")
        recs += r
        spans.update(sp)
    rewards = {f"b{seed}s{i}": float(rng.random()) for i in range(n)}
    return build_samples(
        build_trees(recs, spans=spans), rewards, dict.fromkeys(rewards, "g"), run_id="bench"
    )


def make_trainer(model_dir: str):
    from tasks.train.trainer import Trainer

    return Trainer(model_dir, lr=1e-4, max_tokens_per_micro=512, seed=0, max_grad_norm=0.05)


def _np(t: torch.Tensor) -> np.ndarray:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().numpy().copy()


def clipped_grads(trainer, run):
    """``run()``'s metrics and the (full) gradients AdamW received."""
    got: dict[str, np.ndarray] = {}

    def grab(*_):
        for n, p in trainer.model.named_parameters():
            if p.grad is not None:
                got[n] = _np(p.grad)

    h = trainer.optimizer.register_step_pre_hook(grab)
    try:
        return run(), got
    finally:
        h.remove()


def _member(model_dir: str, spec: dict, inbox, outbox) -> None:
    torch.set_num_threads(1)
    group = trainer = replica = None
    try:
        while (msg := inbox.get()) is not None:
            rv, ops = msg
            if group is None or group.rv != rv:
                if group is not None:
                    group.close()
                group = dp.DPGroup(rv, backend="gloo", timeout_s=300)
                trainer = replica = None
            out: dict = {}
            for op, arg in ops:
                t0 = time.perf_counter()
                if op == "build":
                    trainer = sharded.shard_trainer(make_trainer(model_dir))
                elif op == "replica":
                    replica = make_trainer(model_dir)
                elif op == "load":
                    sharded.load_sharded(trainer, arg)
                elif op == "save":
                    sharded.save_sharded(trainer, arg)
                elif op == "step":
                    b = batch(arg, **spec)
                    out["grads"] = clipped_grads(
                        trainer,
                        lambda b=b, t=trainer, r=rv: sharded.sharded_step(
                            t, b, rank=r.rank, world=r.world
                        ),
                    )[1]
                elif op == "tstep":  # timed: no gradient capture
                    sharded.sharded_step(trainer, batch(arg, **spec), rank=rv.rank, world=rv.world)
                elif op == "rstep":  # replicated DP, as tasks/train_step.py runs it
                    b = batch(arg, **spec)
                    parts = dp.shard([s.n_tokens for s in b], rv.world)
                    n = float(sum(s.n_flat_trainable for s in b)) or 1.0
                    replica.step(
                        [b[i] for i in parts[rv.rank]],
                        normalizer=n,
                        reduce_grads=group.reduce_grads,
                    )
                elif op == "bytes":
                    out["bytes"] = sharded.state_bytes(trainer if arg == "sharded" else replica)
                out.setdefault("t", []).append((op, time.perf_counter() - t0))
            outbox.put(out)
    except Exception:
        outbox.put({"error": traceback.format_exc()})
    finally:
        if group is not None:
            group.close()


class Members:
    def __init__(self, n: int, model_dir: str, spec: dict):
        self.store, self.port = dp.host_store("127.0.0.1", timeout_s=300)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(n)]
        self.procs = [
            ctx.Process(target=_member, args=(model_dir, spec, q, self.outbox), daemon=True)
            for q in self.inboxes
        ]
        for p in self.procs:
            p.start()
        self.generation = -1

    def run(self, who: list[int], ops) -> list[dict]:
        """Members ``who`` (in rank order) form a new generation and run ``ops``."""
        self.generation += 1
        for rank, i in enumerate(who):
            self.inboxes[i].put(
                (dp.Rendezvous("127.0.0.1", self.port, self.generation, rank, len(who)), ops)
            )
        outs = [self.outbox.get(timeout=900) for _ in who]
        for o in outs:
            if "error" in o:
                raise RuntimeError(o["error"])
        return outs

    def close(self) -> None:
        for q in self.inboxes:
            q.put(None)
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def _times(outs: list[dict], op: str) -> float:
    """The slowest member's total seconds in ``op``."""
    return max(sum(t for o2, t in o["t"] if o2 == op) for o in outs)


def _each(outs: list[dict], op: str) -> list[float]:
    """The slowest member's seconds for each run of ``op``, in order."""
    per = [[t for o2, t in o["t"] if o2 == op] for o in outs]
    return [max(ts) for ts in zip(*per, strict=True)]


def replica_reference(model_dir: str, spec: dict, seed: int):
    t = make_trainer(model_dir)
    _, g = clipped_grads(t, lambda: t.step(batch(seed, **spec)))
    return t, g


PARTS = ("state", "regroup", "step")


def bench(
    model_dir: str, *, quick: bool, spec: dict, repeats: int, parts: tuple[str, ...] = PARTS
) -> dict:
    res: dict = {"model": model_dir, "quick": quick, **{f"batch_{k}": v for k, v in spec.items()}}
    tmp = tempfile.mkdtemp(prefix="gyre-bench-sharded-")
    ks = (1, 2, 4)
    n_procs = max(ks) if "state" in parts else 3 if "regroup" in parts else 2
    members = Members(n_procs, model_dir, spec)
    try:
        if "state" in parts:
            _state_part(members, model_dir, spec, ks, res)
        if "regroup" in parts:
            _regroup_part(members, tmp, res)
        if "step" in parts:
            _step_part(members, repeats, res)
    finally:
        members.close()
    return res


def _state_part(members: Members, model_dir: str, spec: dict, ks, res: dict) -> None:
    """State bytes at rest after one step (AdamW moments exist) at each k; the gradients."""
    ref, ref_grads = replica_reference(model_dir, spec, 0)
    replica_bytes = sharded.state_bytes(ref)
    res["replica_state_bytes"] = replica_bytes
    for k in ks:
        outs = members.run(list(range(k)), [("build", None), ("step", 0), ("bytes", "sharded")])
        ratio = max(o["bytes"] for o in outs) / replica_bytes
        res[f"sharded_state_bytes_per_member_over_replica_k{k}"] = ratio
        if k == 2:
            res["sharded_state_bytes_per_member_over_replica"] = ratio
            res["sharded_grad_max_rel_diff"] = max(
                float(np.abs(outs[0]["grads"][n] - g).max() / max(np.abs(g).max(), 1e-30))
                for n, g in ref_grads.items()
            )


def _regroup_part(members: Members, tmp: str, res: dict) -> None:
    """2 -> 3 -> 1: save, reshard (fresh trainer + load), first step."""
    s1, s2 = os.path.join(tmp, "s1"), "file://" + os.path.join(tmp, "s2")
    g0 = members.run([0, 1], [("build", None), ("step", 0), ("save", s1)])
    g1 = members.run([0, 1, 2], [("build", None), ("load", s1), ("step", 1), ("save", s2)])
    g2 = members.run([1], [("build", None), ("load", s2), ("step", 2)])
    save = _times(g0, "save") + _times(g1, "save")
    load = sum(_times(g, "build") + _times(g, "load") for g in (g1, g2))
    first = _times(g1, "step") + _times(g2, "step")
    res.update(
        sharded_regroup_s=save + load + first,
        sharded_regroup_save_s=save,
        sharded_regroup_load_s=load,
        sharded_regroup_step_s=first,
    )


def _step_part(members: Members, repeats: int, res: dict) -> None:
    """Step time at k = 2: sharded vs replicated, interleaved in one generation."""
    ops = [("build", None), ("replica", None)]
    for i in range(repeats + 1):  # the first of each is a warm-up
        ops += [("tstep", 20 + i), ("rstep", 20 + i)]
    outs = members.run([0, 1], ops)
    ts = _each(outs, "tstep")[1:]
    tr = _each(outs, "rstep")[1:]
    res["sharded_step_s"] = statistics.median(ts)
    res["replicated_step_s"] = statistics.median(tr)
    res["sharded_step_over_replicated"] = res["sharded_step_s"] / res["replicated_step_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small batch, 2 repeats (< 1 min)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    ap.add_argument("--model", default="tiny", help="tiny (default), smollm2, or a local HF dir")
    ap.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="which figures: state (bytes per member, gradient agreement; 4 processes), "
        "regroup (3), step (2; the one that fits memory for a pretrained model)",
    )
    args = ap.parse_args()
    parts = tuple(p for p in args.parts.split(",") if p)
    if bad := [p for p in parts if p not in PARTS]:
        ap.error(f"--parts {','.join(bad)}: use some of {','.join(PARTS)}")
    if args.model == "tiny":
        from infra.engine.tiny_model import make_tiny_model

        model_dir = make_tiny_model()
    elif os.path.isdir(args.model):
        model_dir = args.model
    else:
        from infra.engine.pretrained import prepare

        model_dir = prepare(args.model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    spec = {"n": 4 if args.quick else 8, "vocab": vocab, "n_calls": 4 if args.quick else 8}
    res = bench(model_dir, quick=args.quick, spec=spec, repeats=2 if args.quick else 5, parts=parts)
    rows = [
        ("state bytes/member over replica, k=1", "sharded_state_bytes_per_member_over_replica_k1"),
        ("state bytes/member over replica, k=2", "sharded_state_bytes_per_member_over_replica_k2"),
        ("state bytes/member over replica, k=4", "sharded_state_bytes_per_member_over_replica_k4"),
        ("grad max rel diff (k=2 vs replica)", "sharded_grad_max_rel_diff"),
        ("regroup 2->3->1 (s)", "sharded_regroup_s"),
        ("  of it: DCP save (s)", "sharded_regroup_save_s"),
        ("  of it: fresh trainer + load (s)", "sharded_regroup_load_s"),
        ("  of it: first steps (s)", "sharded_regroup_step_s"),
        ("step s, sharded k=2", "sharded_step_s"),
        ("step s, replicated k=2", "replicated_step_s"),
        ("sharded / replicated step", "sharded_step_over_replicated"),
    ]
    print(f"sharded training on {model_dir}")
    for label, key in rows:
        if key in res:
            print(f"  {label:<40} {res[key]:.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "sharded", **res}, f, indent=2)


if __name__ == "__main__":
    main()
