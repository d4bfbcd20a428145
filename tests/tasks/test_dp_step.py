"""Fast: one data-parallel step of the training task over 2 real processes (gloo) equals one
plain Trainer step on the same batch.

``member_step`` (tasks/train_step.py) is run as a training cell runs it: two processes (the
test's own as rank 0, a forked one as rank 1) form a generation, each trains its shard with the whole batch's normaliser, the
gradients are summed (tasks/train/dp.py) and rank 0 commits the new version. Checked
against a single ``Trainer`` on the same samples in the same order: the reduced gradient
(so the members' normalisers add up to the batch's and the gradients are summed, not
averaged), the loss and gradient norm, and the committed weights. The slow join/leave test
(tests/tasks/test_dp.py) covers membership changes. Run on each architecture family (Qwen3,
Llama as SmolLM2 with its tied embedding, Qwen2).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import traceback
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from storage.checkpoints import fetch_checkpoint, publish_checkpoint, read_digest, weights_digest
from storage.store import Store
from tasks.train import dp
from tasks.train.config import TrainConfig
from tasks.train.trainer import Trainer
from tasks.train_step import load_samples, member_step, restore_trainer
from tasks.trajectory.sampler import build_samples
from tasks.trajectory.synth import random_session
from tasks.trajectory.tree import build_trees
from tests.models import ARCHS, micro_config

pytestmark = pytest.mark.integration

RUN = "dp"
CFG = TrainConfig(lr=1e-5, max_tokens_per_micro=96, max_staleness=1, stale_policy="drop")
S_PER_TOKEN = 1e-6  # paced device time per token of a member's shard: a few ms a step


def _grads(model) -> dict[str, np.ndarray]:
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


def _weights(model) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def _member(store_url: str, plan: dp.StepPlan, rank: int, out, cfg: TrainConfig = CFG) -> None:
    """A training cell's part of the step (rank 0 in the test process, so mutmut maps these
    tests to ``member_step``; rank 1 forked); the reduced gradient is recorded. The spy and
    the thread count are put back after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    reduce, pace = dp.DPGroup.reduce_grads, dp.pace
    paced: list[float] = []  # the device time each pacing waited for
    holder = SimpleNamespace(dp=None, trainer=None, trainer_run=None, trainer_key=None)
    try:
        seen: dict[str, np.ndarray] = {}

        def spy(self, model):
            reduce(self, model)
            seen.update(_grads(model))

        dp.DPGroup.reduce_grads = spy
        dp.pace = lambda started, device_s: paced.append(device_s) or pace(started, device_s)
        done = member_step(
            Store(store_url),
            RUN,
            plan,
            rank,
            cfg,
            holder=holder,
            backend="gloo",
            s_per_token=S_PER_TOKEN,
        )
        costs = None if done.costs is None else sorted(done.costs)
        out.put(
            (
                rank,
                done.metrics,
                seen,
                done.checkpoint,
                paced,
                (done.step, done.weight_version, costs),
            )
        )
    except Exception:
        out.put((rank, "error", traceback.format_exc(), "", [], ()))
    finally:
        dp.DPGroup.reduce_grads, dp.pace = reduce, pace
        torch.set_num_threads(threads)
        if holder.dp is not None:
            holder.dp.close()
        elif torch.distributed.is_initialized():  # failed while forming
            torch.distributed.destroy_process_group()


@pytest.fixture(params=ARCHS)
def store_with_batch(request, tmp_path):
    return _store_with_batch(tmp_path, request.param)


def step_order(store: Store, segments, seed: int) -> list:
    """The textbook order of a step's batch: every sample of ``segments`` by id (the same on
    every member), then shuffled by the plan's seed."""
    samples = sorted(
        (s for seg in segments for s in load_samples(store, seg)), key=lambda s: s.sample_id
    )
    random.Random(seed).shuffle(samples)
    return samples


def append_sessions(
    store: Store,
    run_id: str,
    rng: np.random.Generator,
    sids: list[str],
    n_calls: int,
    rewards: dict[str, float] | None = None,
) -> str:
    """One segment of samples from synthetic sessions ``sids`` (every token of version 0),
    rewarded by ``rewards``, else by draws from ``rng`` after the sessions; returns the
    segment."""
    recs, spans = [], {}
    for sid in sids:
        r, sp = random_session(
            rng, n_calls=n_calls, session_id=sid, run_id=run_id, p_version_bump=0
        )
        recs += r
        spans.update(sp)
    if rewards is None:
        rewards = {sid: float(rng.random()) for sid in sids}
    samples = build_samples(
        build_trees(recs, spans=spans), rewards, dict.fromkeys(rewards, "g"), run_id=run_id
    )
    return store.append("samples", [s.to_row() for s in samples])


def micro_store(tmp_path, run_id: str, arch: str = "qwen3", perturb: float = 0.0) -> Store:
    """A store whose ``run_id`` has a micro model (seed 0, its weights moved by ``perturb``
    times a normal draw, so a step's gradients are not those of an initial model) as v0."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(micro_config(arch, 40), attn_implementation="sdpa")
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * perturb)
    model.save_pretrained(tmp_path / "model")
    store = Store(str(tmp_path / "store"))
    publish_checkpoint(store, run_id, str(tmp_path / "model"), 0)
    return store


def _store_with_batch(tmp_path, arch: str):
    store = micro_store(tmp_path, RUN, arch, perturb=0.1)
    sids = [f"s{i}" for i in range(6)]
    return store, append_sessions(store, RUN, np.random.default_rng(3), sids, n_calls=5)


def test_two_members_make_the_one_member_step(store_with_batch):
    _two_members_equal_one(*store_with_batch, CFG)


def test_context_parallel_members_make_the_one_member_step(tmp_path):
    """``train.context_parallel_tokens``: the longest samples are trained by both members
    together (each a slice), the rest shard; the step is still the one-member step."""
    store, seg = _store_with_batch(tmp_path, "qwen3")
    sizes = sorted(s.n_tokens for s in load_samples(store, seg))
    cfg = CFG.model_copy(update={"context_parallel_tokens": sizes[len(sizes) // 2]})
    metrics = _two_members_equal_one(store, seg, cfg)
    assert metrics["train/context_parallel_samples"] >= 1


def test_two_sharded_members_make_the_one_member_step(tmp_path):
    """``train.sharding=fsdp``: weights, gradients and AdamW state split over the members
    (tasks/train/sharded.py); the loss, the global gradient norm and the committed
    (consolidated) weights are the one-member step's, the weights' digest is the served
    one's, and the step's sharded state is committed with it."""
    store, seg = _store_with_batch(tmp_path, "qwen3")
    metrics = _two_members_equal_one(store, seg, CFG.model_copy(update={"sharding": "fsdp"}))
    assert metrics["train/dp_sync"] == 2.0  # v0: no sharded state, AdamW fresh
    assert store.exists("checkpoints/dp/v1/sharded/.metadata")
    ckpt = fetch_checkpoint(store, RUN, 1)
    served = Trainer(ckpt, lr=CFG.lr)
    assert read_digest(ckpt)["sha256"] == weights_digest(served.model)


def _two_members_equal_one(store, seg, cfg: TrainConfig) -> dict:
    port_store, port = dp.host_store("127.0.0.1")
    plan = dp.StepPlan(
        step=0,
        version=0,
        generation=0,
        host="127.0.0.1",
        port=port,
        members=("a", "b"),
        groups=(0,),
        segments=(seg,),
        shuffle_seed=5,
    )
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    other = ctx.Process(target=_member, args=(store.url, plan, 1, out, cfg))
    other.start()
    here: queue.Queue = queue.Queue()
    try:
        _member(store.url, plan, 0, here, cfg)  # rank 0, in this process
        got = {}
        for res in (here.get_nowait(), out.get(timeout=120)):
            rank, metrics, grads, ckpt, paced, done = res
            assert metrics != "error", f"rank {rank}: {grads}"
            got[rank] = (metrics, grads, ckpt, paced)
            # every member's result: the step, the version it made, its own costs (rank 0's
            # with its commit's)
            commit = ["commit_s"] if rank == 0 else []
            assert done == (0, 1, sorted(["begin_t", "form_s", "sync_s", "train_s", *commit]))
    finally:
        other.join(timeout=30)
        if other.is_alive():
            other.kill()
        del port_store

    # the reference: one trainer, the same samples in the same order, no reduction
    samples = step_order(store, [seg], plan.shuffle_seed)
    sizes = [s.n_tokens for s in samples]
    long: list[int] = []
    if cfg.context_parallel_tokens:
        long, parts = dp.shard_with_context_parallel(sizes, 2, cfg.context_parallel_tokens)
    else:
        parts = dp.shard(sizes, 2)
    assert all(parts), "both members must train part of the batch"
    ref = restore_trainer(store, RUN, 0, cfg)
    ref_grads: dict[str, np.ndarray] = {}
    ref_m = ref.step(samples, reduce_grads=lambda m: ref_grads.update(_grads(m)))

    for rank, (m, grads, _, paced) in got.items():
        # paced per token of its shard, a context-parallel sample's split over the members
        mine = sum(sizes[i] for i in parts[rank]) + sum(sizes[i] for i in long) / 2
        assert paced and all(p == pytest.approx(S_PER_TOKEN * mine) for p in paced), rank
        # a sharded step sums its gradients in FSDP2, not DPGroup.reduce_grads: no spy
        assert grads.keys() == (ref_grads.keys() if cfg.sharding == "replicate" else set())
        for k, g in (ref_grads if grads else {}).items():
            err = float(np.abs(grads[k] - g).max())
            assert err <= 1e-6 * max(1.0, float(np.abs(g).max())), f"rank {rank} grad {k}: {err}"
        assert m["train/grad_norm"] == pytest.approx(ref_m["train/grad_norm"], rel=1e-5)
        assert m["train/loss"] == pytest.approx(ref_m["train/loss"], rel=1e-5, abs=1e-8)
        assert m["train/trainable_tokens"] == ref_m["train/trainable_tokens"]
        assert m["train/context_parallel_samples"] == len(long)  # none without the setting
        # the batch's mean reward, not this member's shard's
        assert m["train/reward_mean"] == pytest.approx(float(np.mean([x.reward for x in samples])))
    # rank 0 committed v1: the one-member weights
    assert got[0][2] and got[1][2] == ""
    committed = Trainer(fetch_checkpoint(store, RUN, 1), lr=cfg.lr)
    want = _weights(ref.model)
    for k, w in _weights(committed.model).items():
        assert float(np.abs(w - want[k]).max()) <= 1e-6, k
    return got[0][0]
