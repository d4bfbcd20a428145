"""Fast: ``train.sharding=fsdp`` through the training task over a changing member set.

Three forked processes act as training cells, each keeping its holder (trainer and DP
group) between steps as a cell's plugin does, and run ``member_step`` (tasks/train_step.py)
for four steps over members (a, b) -> (a, b, c) -> (b, a) -> (b): every generation is a
membership change, b survives all of them (rank 1, 1, 0, then 0, the committing member), and
a and b meet again at the first group's size with their ranks swapped (DeviceMesh equality
ignores the rank: tasks/train/sharded.py). Each step must equal one plain Trainer's step on
the same samples in the same order (loss, gradient norm) and the committed consolidated
weights of v4 must be the one trainer's after four steps:
the regrouped members resumed from the committed step's sharded DCP state, AdamW moments
included (a fresh AdamW after a regroup moves every weight by ~lr differently). The old
versions' sharded state goes with their optimizer state (``drop_optimizer_state``).
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from storage.checkpoints import (
    drop_optimizer_state,
    fetch_checkpoint,
    read_digest,
    weights_digest,
)
from storage.store import Store
from tasks.train import dp
from tasks.train.config import TrainConfig
from tasks.train.trainer import Trainer
from tasks.train_step import drop_stale, member_step, restore_trainer
from tests.tasks.test_dp_step import RUN, _store_with_batch, _weights, append_sessions, step_order

pytestmark = pytest.mark.integration

# staleness 10: the synthetic tokens are all of version 0, and all of them train at v2
CFG = TrainConfig(
    lr=1e-5, max_tokens_per_micro=96, max_staleness=10, stale_policy="drop", sharding="fsdp"
)
STEPS = (("a", "b"), ("a", "b", "c"), ("b", "a"), ("b",))


def _cell_loop(name: str, store_url: str, inbox, outbox) -> None:
    """A training cell's process: one member_step per plan it is sent, its holder kept."""
    torch.set_num_threads(1)
    holder = SimpleNamespace(dp=None, trainer=None, trainer_run=None, trainer_key=None)
    try:
        while (msg := inbox.get()) is not None:
            plan, rank = msg
            done = member_step(
                Store(store_url), RUN, plan, rank, CFG, holder=holder, backend="gloo"
            )
            outbox.put((name, done.metrics, done.checkpoint))
    except Exception:
        outbox.put((name, "error", traceback.format_exc()))
    finally:
        if holder.dp is not None:
            holder.dp.close()


def _segment(store: Store, seed: int) -> str:
    sids = [f"s{seed}-{i}" for i in range(5)]
    return append_sessions(store, RUN, np.random.default_rng(seed), sids, n_calls=4)


def _batch(store: Store, plan: dp.StepPlan):
    """The step's samples as member_step trains them: sorted, shuffled, stale dropped."""
    samples = step_order(store, plan.segments, plan.shuffle_seed)
    return [drop_stale(s, plan.version, CFG.max_staleness)[0] for s in samples]


def test_sharded_members_regroup_two_three_swapped_one_and_resume_exactly(tmp_path):
    store, seg0 = _store_with_batch(tmp_path, "qwen3")
    segs = [seg0, _segment(store, 11), _segment(store, 12), _segment(store, 13)]
    port_store, port = dp.host_store("127.0.0.1", timeout_s=120)
    ctx = mp.get_context("fork")
    outbox = ctx.Queue()
    inboxes = {n: ctx.Queue() for n in "abc"}
    procs = {
        n: ctx.Process(target=_cell_loop, args=(n, store.url, inboxes[n], outbox)) for n in "abc"
    }
    for p in procs.values():
        p.start()
    plans, got = [], []
    try:
        for step, members in enumerate(STEPS):
            plan = dp.StepPlan(
                step=step,
                version=step,
                generation=step,
                host="127.0.0.1",
                port=port,
                members=members,
                groups=(step,),
                segments=(segs[step],),
                shuffle_seed=step + 5,
            )
            plans.append(plan)
            for rank, n in enumerate(members):
                inboxes[n].put((plan, rank))
            out = {}
            for _ in members:
                name, metrics, ckpt = outbox.get(timeout=180)
                assert metrics != "error", f"{name} at step {step}: {ckpt}"
                out[name] = (metrics, ckpt)
            got.append(out)
    finally:
        for q in inboxes.values():
            q.put(None)
        for p in procs.values():
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        del port_store

    # how each member came to the step's start: v0 has no sharded state; every later
    # generation is new, so every member (survivors too) resharded from the store
    want_sync = [2.0, 3.0, 3.0, 3.0]
    ref = restore_trainer(store, RUN, 0, CFG.model_copy(update={"sharding": "replicate"}))
    for step, plan in enumerate(plans):
        ref_m = ref.step(_batch(store, plan), current_version=plan.version)
        for name, (m, ckpt) in got[step].items():
            assert m["train/dp_sync"] == want_sync[step], (step, name)
            assert m["train/loss"] == pytest.approx(ref_m["train/loss"], rel=1e-5), (step, name)
            assert m["train/grad_norm"] == pytest.approx(ref_m["train/grad_norm"], rel=1e-5)
            assert bool(ckpt) == (name == plan.members[0])
    ckpt = fetch_checkpoint(store, RUN, 4)
    committed = Trainer(ckpt, lr=CFG.lr)
    assert read_digest(ckpt)["sha256"] == weights_digest(committed.model)
    want = _weights(ref.model)
    for k, w in _weights(committed.model).items():
        assert float(np.abs(w - want[k]).max()) <= 1e-6, k

    # the commit of v4 dropped v2's state (a commit keeps its own version's and the step's
    # start version's: storage/commits.py), sharded/ included; v3 goes when asked
    assert not store.exists(f"checkpoints/{RUN}/v1/sharded")
    assert not store.exists(f"checkpoints/{RUN}/v2/sharded")
    assert store.exists(f"checkpoints/{RUN}/v3/sharded/.metadata")
    assert drop_optimizer_state(store, RUN, below=4) == [3]
    assert not store.exists(f"checkpoints/{RUN}/v3/sharded")
    assert store.exists(f"checkpoints/{RUN}/v4/sharded/.metadata")
