"""Dynamic-membership data parallel: k members make the one-member update, across joins and
leaves, with real processes and gloo (tasks/train/dp.py).

Three worker processes (A, B, C) train four steps while the membership changes:
{A, B} -> C joins {A, B, C} (it has no replica: model and optimizer arrive by broadcast) ->
B leaves {A, C} (C takes rank 1) -> B rejoins with a stale replica {B, A} (the state comes
from rank 1). At every step the members' combined gradient must equal the gradient of one
plain Trainer on the same batch, and so must the weights after the AdamW step (fp32,
<= 1e-6), and all members must hold bit-identical weights.

Why ``LR = 1e-5`` (the Trainer's default): the combined gradient differs from the one-member
gradient only by fp32 summation order (~1e-7 here, |g| up to ~0.4); AdamW's first steps
move each weight by ``lr * g / (|g| + eps)``, which maps that rounding on coordinates with
|g| near eps (1e-8) to up to ~1% of ``lr`` -- 8e-5 at lr=1e-2, 8e-8 at lr=1e-5. Any two
fp32 programs that sum in a different order (one member with another micro-batch size,
too) differ that much; the gradient check below is the order-independent statement.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.train import dp
from tests.models import micro_config
from tests.tasks import dp_members

pytestmark = pytest.mark.integration

LR = 1e-5
TOL = 1e-6


def _model_dir(root: Path, arch: str = "qwen3") -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = micro_config(arch, 40)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    d = root / "model"
    model.save_pretrained(d)
    return str(d)


def _batch(seed: int, n: int = 5):
    from tasks.trajectory.sampler import build_samples
    from tasks.trajectory.synth import random_session
    from tasks.trajectory.tree import build_trees

    rng = np.random.default_rng(seed)
    recs, spans = [], {}
    for i in range(n):
        r, sp = random_session(rng, n_calls=6, session_id=f"b{seed}s{i}")
        recs += r
        spans.update(sp)
    rewards = {f"b{seed}s{i}": float(rng.random()) for i in range(n)}
    return build_samples(
        build_trees(recs, spans=spans), rewards, dict.fromkeys(rewards, "g"), run_id="t"
    )


def _trainer(model_dir: str):
    from tasks.train.trainer import Trainer

    return Trainer(model_dir, lr=LR, max_tokens_per_micro=96, seed=0)


def _weights(trainer) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters()}


def _grads(model) -> dict[str, np.ndarray]:
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


def _member(name: str, model_dir: str, inbox, outbox) -> None:
    """A worker process: forms the generation it is told, syncs state, trains its shard."""
    torch.set_num_threads(1)
    trainer, group = None, None
    try:
        while (msg := inbox.get()) is not None:
            rv, batch_seed, version = msg
            if group is None or group.rv != rv:
                if group is not None:
                    group.close()
                group = dp.DPGroup(rv, backend="gloo", timeout_s=120)
            trainer, how = dp.sync_state(group, trainer, version, lambda: _trainer(model_dir))
            samples = _batch(batch_seed)
            parts = dp.shard([s.n_tokens for s in samples], group.world)
            mine = [samples[i] for i in parts[group.rank]]
            normalizer = float(sum(s.n_flat_trainable for s in samples))
            grads: dict[str, np.ndarray] = {}

            def reduce(model, group=group, grads=grads):
                group.reduce_grads(model)
                grads.update(_grads(model))

            m = trainer.step(mine, normalizer=normalizer, reduce_grads=reduce)
            m = group.reduce_metrics(m)
            out = (how, m["train/loss"], _weights(trainer), grads, trainer.version)
            outbox.put((name, out))
    except Exception:
        outbox.put((name, ("error", traceback.format_exc(), None, None, None)))
    finally:
        if group is not None:
            group.close()


def test_shard_is_balanced_deterministic_and_complete():
    parts = dp.shard([5, 1, 4, 4, 2, 0], 3)
    assert sorted(i for p in parts for i in p) == [0, 1, 2, 3, 4, 5]
    # longest first onto the least loaded (ties: lower rank): 5|4|4, then 2 -> r1, 1 -> r2, 0 -> r0
    assert parts == [[0, 5], [2, 4], [1, 3]]
    assert dp.shard([3], 2) == [[0], []]  # an idle member still takes part in the step


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # llama: a tied embedding is broadcast
def test_k_members_equal_one_across_join_and_leave(tmp_path, arch):
    model_dir = _model_dir(tmp_path, arch)
    store, port = dp.host_store("127.0.0.1")
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    inboxes = {n: ctx.Queue() for n in "ABC"}
    procs = {
        n: ctx.Process(target=_member, args=(n, model_dir, inboxes[n], outbox), daemon=True)
        for n in "ABC"
    }
    for p in procs.values():
        p.start()
    ref = _trainer(model_dir)
    schedule = [("AB", 0), ("ABC", 1), ("AC", 2), ("BA", 3)]
    hows = []
    try:
        for gen, (members, seed) in enumerate(schedule):
            version = ref.version
            for rank, n in enumerate(members):
                rv = dp.Rendezvous("127.0.0.1", port, gen, rank, len(members))
                inboxes[n].put((rv, seed, version))
            ref_grads: dict[str, np.ndarray] = {}
            ref_m = ref.step(_batch(seed), reduce_grads=lambda m, g=ref_grads: g.update(_grads(m)))
            want = _weights(ref)
            got = {}
            for _ in members:
                name, out = outbox.get(timeout=300)
                assert out[0] != "error", f"member {name}: {out[1]}"
                got[name] = out
            hows.append({n: got[n][0] for n in members})
            first = got[members[0]]
            for n in members:
                _, loss, w, g, v = got[n]
                assert v == ref.version
                assert loss == pytest.approx(ref_m["train/loss"], rel=1e-5, abs=1e-7)
                assert g.keys() == ref_grads.keys()
                for k, x in ref_grads.items():
                    err = float(np.abs(g[k] - x).max())
                    assert err <= TOL, f"step {gen} member {n} grad {k}: |dg| = {err:.2e}"
                for k, x in want.items():
                    err = float(np.abs(w[k] - x).max())
                    assert err <= TOL, f"step {gen} member {n} {k}: |dw| = {err:.2e}"
                    assert np.array_equal(w[k], first[2][k]), "members disagree"
    finally:
        for q in inboxes.values():
            q.put(None)
        for p in procs.values():
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        del store
    assert hows[0] == {"A": "checkpoint", "B": "checkpoint"}  # nobody held v0 in memory
    assert hows[1] == {"A": "broadcast", "B": "broadcast", "C": "broadcast"}  # C joins
    assert hows[2] == {"A": "kept", "C": "kept"}  # B left; A and C hold v2
    assert hows[3]["B"] == "broadcast"  # B rejoins with v2 and receives v3


def _meet(generation: int, port: int, rank: int, fail_first: bool, out) -> None:
    try:
        if fail_first:  # a formation whose partner never came (lost while meeting)
            with pytest.raises(dp.DPError):
                dp.DPGroup(dp.Rendezvous("127.0.0.1", port, generation - 1, rank, 2), timeout_s=2)
        group = dp.DPGroup(dp.Rendezvous("127.0.0.1", port, generation, rank, 2), timeout_s=60)
        t = torch.ones(1)
        torch.distributed.all_reduce(t)
        group.close()
        out.put((rank, float(t[0])))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def test_a_member_whose_formation_failed_meets_a_fresh_joiner():
    """A member that failed to form one generation (its partner lost while they met) and a
    fresh process (the restarted worker) form the next: before, the survivor's group name
    counted the failed try and the two never met (the run hung until the step timeout)."""
    store, port = dp.host_store("127.0.0.1", timeout_s=60)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_meet, args=(1, port, 0, True, out), daemon=True),
        ctx.Process(target=_meet, args=(1, port, 1, False, out), daemon=True),
    ]
    procs[0].start()
    procs[0].join(timeout=0.1)
    import time

    time.sleep(8)  # the survivor's failed try is over before the joiner starts
    procs[1].start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert got == {0: 2.0, 1: 2.0}, got
    del store


def test_each_generation_meets_under_keys_of_its_own():
    """Two members form generation 0, then generation 1 with their ranks swapped, one of
    them late: the early one must wait for its peer's generation-1 keys, never take the
    stale generation-0 address its peer left in the store (a group formed on it never
    meets: the step fails at the timeout). The store grows by a generation's worth of
    keys each time: no key of generation 0 is written again by generation 1."""
    store, port = dp.host_store("127.0.0.1", timeout_s=60)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    inboxes = [ctx.Queue(), ctx.Queue()]
    procs = [
        ctx.Process(target=dp_members.generations, args=(q, out), daemon=True) for q in inboxes
    ]
    for p in procs:
        p.start()
    sizes = [store.num_keys()]
    try:
        # (generation, {member: (rank, delay s)})
        plan = [(0, {0: (0, 0.0), 1: (1, 0.0)}), (1, {0: (1, 0.0), 1: (0, 3.0)})]
        for gen, members in plan:
            for m, (rank, delay) in members.items():
                inboxes[m].put((dp.Rendezvous("127.0.0.1", port, gen, rank, 2), delay))
            got = sorted(out.get(timeout=120) for _ in members)
            assert all(g != -1 for g, _, _ in got), got
            assert got == [(gen, 0, 3.0), (gen, 1, 3.0)], got
            sizes.append(store.num_keys())
    finally:
        for q in inboxes:
            q.put(None)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    first, second = sizes[1] - sizes[0], sizes[2] - sizes[1]
    assert first > 0 and second == first, sizes  # fresh keys, as many as the first time
    del store
