"""What a committed step records (``commit_step`` in tasks/train_step.py), where generated
mutants survived the other fast tests (bench/mutation.py): each ledger row's lag (a number
for a sample with policy tokens, null for one without), the steps row's dropped tokens, the
same in the commit record as in the datasets; what a step run without a cell
(``train_on_samples``: tests, tools) records as its cell and its start; and ``member_step``
run in the test process, one member (the DP tests run it in other processes, where mutmut
does not see it): its group and replica kept or rebuilt, the lag bound, pacing, its costs and
row, the ledger's refusal, and the sharded path's keep and reshard."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from storage.checkpoints import fetch_checkpoint, publish_checkpoint, stage_checkpoint
from storage.commits import committed_steps
from storage.store import Store
from tasks.train import dp, sharded
from tasks.train.config import TrainConfig
from tasks.train.trainer import Trainer
from tasks.train_step import (
    LedgerError,
    _trainer_kwargs,
    commit_step,
    drop_stale,
    load_samples,
    member_step,
    restore_sharded,
    restore_trainer,
    sample_lag,
)
from tasks.trajectory.sampler import build_samples
from tests.tasks.test_dp_step import append_sessions, micro_store, step_order
from tests.tasks.trajectory.test_sampler import small_tree

METRICS = {
    "train/loss": 0.5,
    "train/tokens": 12,
    "train/trainable_tokens": 6,
    "train/reward_mean": 1.0,
    "train/grad_norm": 0.25,
    "train/dropped_stale_tokens": 3,
}


def test_the_ledger_and_steps_rows_carry_lag_and_dropped_tokens(tmp_path):
    store = Store(str(tmp_path / "store"))
    (policy,) = build_samples([small_tree("s", (0, 2, 2, 2))], {"s": 1.0}, advantage="reward")
    (copied,) = build_samples([small_tree("t", (-1, -1, -1, -1))], {"t": 1.0}, advantage="reward")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    url = stage_checkpoint(store, "r1", str(tmp_path / "ckpt"), 3)
    done = commit_step(
        store,
        "r1",
        2,
        SimpleNamespace(version=3),  # a staged step: commit_step reads only its version
        2,
        [policy, copied],
        METRICS,
        members=("cell-a",),
        t_start=time.time(),
        staged=url,
    )
    (rec,) = committed_steps(store, "r1")
    assert done.checkpoint == url == rec["steps"]["checkpoint"]  # the staged one's URL
    mean, mx, n = sample_lag(policy, 2)
    assert n > 0 and mean > 0
    by_id = {r["sample_id"]: r for r in rec["ledger"]}
    assert by_id[policy.sample_id]["lag_mean"] == pytest.approx(mean)
    assert by_id[policy.sample_id]["lag_max"] == mx
    assert by_id[copied.sample_id]["lag_mean"] is None
    assert by_id[copied.sample_id]["lag_max"] is None
    steps = rec["steps"]
    assert steps["dropped_tokens"] == 3
    assert steps["lag_mean"] == pytest.approx(mean) == done.metrics["train/lag_mean"]
    assert steps["n_members"] == 1 and steps["weight_version"] == 3


class _Saver(SimpleNamespace):
    """A trainer as ``commit_step`` uses one it stages itself: its version and ``save``."""

    def save(self, path: str) -> None:
        with open(f"{path}/config.json", "w") as fh:
            fh.write(json.dumps({"saved": self.version}))


def test_a_commit_stages_the_trainer_and_records_its_whole_rows(tmp_path):
    """Unstaged: the trainer's own save is staged as the version's checkpoint. The steps row
    and each ledger row hold exactly these fields (the steps row also in the ``steps``
    dataset); the step's defaults are generation 0 and no mode."""
    store = Store(str(tmp_path / "store"))
    (policy,) = build_samples([small_tree("s", (0, 2, 2, 2))], {"s": 1.0}, advantage="reward")
    t0 = time.time()
    done = commit_step(
        store, "r1", 4, _Saver(version=3), 2, [policy], METRICS, members=("a", "b"), t_start=t0
    )
    (rec,) = committed_steps(store, "r1")
    url = store.full_url("checkpoints/r1/v3")
    assert done.checkpoint == url and done.step == 4 and done.weight_version == 3
    with open(f"{fetch_checkpoint(store, 'r1', 3)}/config.json") as fh:
        assert json.load(fh) == {"saved": 3}
    mean, mx, _ = sample_lag(policy, 2)
    row = rec["steps"]
    t1 = row["t_end"]
    assert t0 <= t1 <= time.time()
    assert row == {
        "run_id": "r1",
        "step": 4,
        "weight_version": 3,
        "loss": 0.5,
        "tokens": 12,
        "trainable_tokens": 6,
        "reward": 1.0,
        "n_samples": 1,
        "grad_norm": 0.25,
        "mean_staleness": pytest.approx(mean),
        "cells": ["a", "b"],
        "t_start": t0,
        "t_end": t1,
        "checkpoint": url,
        "lag_mean": pytest.approx(mean),
        "lag_max": mx,
        "n_members": 2,
        "generation": 0,
        "mode": "",
        "dropped_tokens": 3,
    }
    assert rec["ledger"] == [
        {
            "run_id": "r1",
            "step": 4,
            "sample_id": policy.sample_id,
            "weight_version": 3,
            "t": t1,
            "lag_mean": pytest.approx(mean),
            "lag_max": mx,
        }
    ]
    (stored,) = store.read("steps").to_pylist()
    assert stored["step"] == 4 and stored["checkpoint"] == url and stored["lag_max"] == mx
    assert done.metrics == {**METRICS, "train/lag_mean": pytest.approx(mean), "train/lag_max": mx}


def test_a_step_without_policy_tokens_has_lag_zero_and_no_dropped_count_means_zero(tmp_path):
    store = Store(str(tmp_path / "store"))
    (copied,) = build_samples([small_tree("t", (-1, -1, -1, -1))], {"t": 1.0}, advantage="reward")
    metrics = {k: v for k, v in METRICS.items() if k != "train/dropped_stale_tokens"}
    done = commit_step(
        store, "r1", 0, _Saver(version=1), 0, [copied], metrics, members=("a",), t_start=0.0
    )
    (rec,) = committed_steps(store, "r1")
    row = rec["steps"]
    assert (row["lag_mean"], row["lag_max"], row["mean_staleness"]) == (0.0, 0, 0.0)
    assert row["dropped_tokens"] == 0
    assert done.metrics["train/lag_mean"] == 0.0 and done.metrics["train/lag_max"] == 0.0


def test_a_restored_trainer_with_kl_gets_the_warm_start_as_reference(tmp_path):
    from storage.checkpoints import commit_checkpoint
    from tasks.train_step import _restore_kwargs

    store = Store(str(tmp_path / "store"))
    (tmp_path / "v0").mkdir()
    (tmp_path / "v0" / "config.json").write_text("{}")
    stage_checkpoint(store, "r1", str(tmp_path / "v0"), 0)
    commit_checkpoint(store, "r1", 0)
    got = _restore_kwargs(store, "r1", TrainConfig(kl_coef=0.1))
    assert got["ref_model_dir"] == fetch_checkpoint(store, "r1", 0)
    assert "ref_model_dir" not in _restore_kwargs(store, "r1", TrainConfig(kl_coef=0.0))


def test_a_step_without_a_cell_records_the_local_cell_and_its_start(tmp_path):
    """``train_on_samples`` with no ``cell_id``: the steps row names the cell ``local`` and
    starts when the call did (before the step's end), not at an unset time."""
    from infra.engine.tiny_model import make_tiny_model
    from tasks.train_step import train_on_samples

    store = Store(str(tmp_path / "store"))
    publish_checkpoint(store, "r1", make_tiny_model(), 0)
    samples = build_samples([small_tree("s", (0, 0, 0, 0))], {"s": 1.0}, advantage="reward")
    seg = store.append("samples", [smp.to_row() for smp in samples])
    before = time.time()
    train_on_samples(store, "r1", 0, seg, TrainConfig(lr=1e-3))
    after = time.time()
    (rec,) = committed_steps(store, "r1")
    steps = rec["steps"]
    assert steps["cells"] == ["local"] and steps["n_members"] == 1
    assert before <= steps["t_start"] <= steps["t_end"] <= after


# -- member_step in the test process (mutmut maps it only where the test process runs it) --

MRUN = "m"
COST_KEYS = {"begin_t", "form_s", "sync_s", "train_s", "commit_s"}


def _member_store(tmp_path):
    """A micro Qwen3 at v0 and four segments of two sessions each, every token of version 0."""
    store = micro_store(tmp_path, MRUN)
    rng = np.random.default_rng(7)
    segs = [
        append_sessions(
            store,
            MRUN,
            rng,
            [f"s{k}0", f"s{k}1"],
            n_calls=4,
            rewards={f"s{k}{i}": float(k + i) for i in range(2)},
        )
        for k in range(4)
    ]
    return store, segs


def _plan(port: int, step: int, version: int, seg: str, generation: int = 0, **kw):

    return dp.StepPlan(
        step=step,
        version=version,
        generation=generation,
        host="127.0.0.1",
        port=port,
        members=("cell-a",),
        groups=(step,),
        segments=(seg,),
        shuffle_seed=11 + step,
        **kw,
    )


def _reference(store, version: int, seg: str, seed: int, cfg):
    """The textbook step: the replica at ``version``, the segment's samples in id order then
    shuffled by the plan's seed, tokens past the lag bound dropped, one Trainer step."""
    samples = step_order(store, [seg], seed)
    kept = [drop_stale(s, version, cfg.max_staleness) for s in samples]
    ref = restore_trainer(store, MRUN, version, cfg)
    ref.step([s for s, _ in kept], current_version=version)
    return ref, sum(n for _, n in kept), [s.reward for s in samples]


def _weights_equal(store, version: int, model, cfg) -> None:

    got = Trainer(fetch_checkpoint(store, MRUN, version), lr=cfg.lr).model.state_dict()
    for k, w in model.state_dict().items():
        assert float((got[k] - w).abs().max()) <= 1e-6, (version, k)


def test_a_one_member_step_in_process_keeps_its_group_and_replica_and_commits(
    tmp_path, monkeypatch
):
    """``member_step`` as a cell runs it, one member: v0 loaded from the checkpoint, then the
    replica and the group kept, a new generation re-forms the group, a replica of another
    run is not used, tokens past the lag bound are dropped, each committed version is the
    textbook step's, each step's row and costs are its own, and a replayed batch is refused."""

    cfg = TrainConfig(lr=1e-3, max_tokens_per_micro=96, max_staleness=1, stale_policy="drop")
    store, segs = _member_store(tmp_path)
    server, port = dp.host_store("127.0.0.1", timeout_s=60)
    holder = SimpleNamespace(
        dp=None,
        trainer=None,
        trainer_run=None,
        trainer_key=None,
        worker_address="tcp://127.0.0.1:1",
    )
    try:
        rows = []

        def step(plan, **kw):
            before = time.time()
            if torch.cuda.is_available():  # the default backend ("auto") is NCCL there
                kw.setdefault("backend", "gloo")
            done = member_step(store, MRUN, plan, 0, cfg, holder=holder, **kw)
            assert holder.dp.backend == "gloo"
            assert set(done.costs) == COST_KEYS
            assert before <= done.costs["begin_t"] <= time.time()
            assert done.step == plan.step and done.weight_version == plan.version + 1
            assert holder.trainer.version == plan.version + 1
            assert holder.trainer_run == (store.url, MRUN)
            assert holder.dp.rv == plan.rendezvous(0)
            rows.append(done)
            return done

        # v0: no replica anywhere, so the checkpoint; the group formed for it
        ref0, dropped0, rewards0 = _reference(store, 0, segs[0], 11, cfg)
        p0 = _plan(port, 0, 0, segs[0])
        d0 = step(p0, mode="elastic")
        group0, replica = holder.dp, holder.trainer
        assert d0.metrics["train/dp_sync"] == 2.0 and d0.costs["form_s"] > 0
        assert d0.metrics["train/dropped_stale_tokens"] == dropped0 == 0
        assert d0.metrics["train/reward_mean"] == pytest.approx(float(np.mean(rewards0)))
        assert d0.metrics["train/context_parallel_samples"] == 0.0
        _weights_equal(store, 1, ref0.model, cfg)

        # v1, the same rendezvous: group and replica kept, no formation time
        ref1, _, _ = _reference(store, 1, segs[1], 12, cfg)
        d1 = step(_plan(port, 1, 1, segs[1]))
        assert holder.dp is group0 and holder.trainer is replica
        assert d1.metrics["train/dp_sync"] == 0.0 and d1.costs["form_s"] == 0.0
        _weights_equal(store, 2, ref1.model, cfg)

        # v2, a new generation: the group re-formed; the replica is still this run's, kept.
        # segs[2]'s tokens are of version 0: past the bound (2 - 1), all dropped
        ref2, dropped2, _ = _reference(store, 2, segs[2], 13, cfg)
        assert dropped2 > 0
        n2 = sum(smp.n_tokens for smp in load_samples(store, segs[2]))
        # paced per token: from the compute's start, after the batch is loaded
        import tasks.train_step as ts

        loads, paces = [], []
        load, pace = ts.load_samples, dp.pace
        monkeypatch.setattr(
            ts, "load_samples", lambda *a: loads.append(time.monotonic()) or load(*a)
        )
        monkeypatch.setattr(dp, "pace", lambda t, s: paces.append((t, s)) or pace(t, s))
        d2 = step(_plan(port, 2, 2, segs[2], generation=1), s_per_token=1.0 / n2)
        monkeypatch.undo()
        assert paces and all(t > loads[-1] and s == pytest.approx(1.0) for t, s in paces)
        assert holder.dp is not group0 and d2.costs["form_s"] > 0
        assert d2.metrics["train/dp_sync"] == 0.0
        assert d2.metrics["train/dropped_stale_tokens"] == dropped2
        _weights_equal(store, 3, ref2.model, cfg)

        # a replica of another run is no replica of this one: the checkpoint again
        holder.trainer_run = ("elsewhere", MRUN)
        paced = _plan(port, 3, 3, segs[0], generation=1, pace_s=1.0)
        with pytest.raises(LedgerError, match="step 3: 2 samples already trained"):
            member_step(store, MRUN, paced, 0, cfg, holder=holder, backend="gloo")
        assert holder.trainer is not replica and holder.trainer.version == 3  # loaded

        # paced: the step's device time (from the member's start) has passed before it ends
        d3 = step(replace(paced, segments=(segs[3],)))
        assert d3.costs["form_s"] + d3.costs["sync_s"] + d3.costs["train_s"] >= 1.0
        # and per token of the shard where no step time is given (d2: 1 s in all), counted
        # from the compute's start
        assert d2.costs["train_s"] >= 0.99

        (rec0, rec1, rec2, _) = committed_steps(store, MRUN)
        for rec, done, gen, mode in (
            (rec0, d0, 0, "elastic"),
            (rec1, d1, 0, ""),
            (rec2, d2, 1, ""),
        ):
            row = rec["steps"]
            assert row["cells"] == ["cell-a"] and row["n_members"] == 1
            assert row["generation"] == gen and row["mode"] == mode
            assert row["t_start"] == done.costs["begin_t"]
            assert row["dropped_tokens"] == done.metrics["train/dropped_stale_tokens"]
            assert done.checkpoint == row["checkpoint"]
        assert all(d.costs["train_s"] > 0 and d.costs["commit_s"] > 0 for d in rows)
        assert all(0 <= d.costs["sync_s"] < 60 for d in rows)
    finally:
        if holder.dp is not None:
            holder.dp.close()
        del server


def test_a_one_member_sharded_step_in_process_keeps_then_reshards(tmp_path, caplog):
    """``train.sharding=fsdp``, one member in the test process, after a replicated step: v1
    has no sharded state, so the consolidated weights and a fresh AdamW (warned, counters
    from the checkpoint); then the sharded trainer kept on the same group; then rebuilt from
    the committed sharded state on a new generation (its FSDP mesh was the old group's).
    Each committed version is what one plain Trainer stepping through the same batches (its
    AdamW fresh where the sharded one's is) commits."""
    cfg = TrainConfig(lr=1e-3, max_tokens_per_micro=96, max_staleness=8)
    fsdp = cfg.model_copy(update={"sharding": "fsdp"})
    store, segs = _member_store(tmp_path)
    server, port = dp.host_store("127.0.0.1", timeout_s=60)
    holder = SimpleNamespace(dp=None, trainer=None, trainer_run=None, trainer_key=None)
    ref = restore_trainer(store, MRUN, 0, cfg)
    try:
        got = []
        for k, gen, c in ((0, 0, cfg), (1, 0, fsdp), (2, 0, fsdp), (3, 1, fsdp)):
            plan = _plan(port, k, k, segs[k], generation=gen)
            kept = holder.trainer
            with caplog.at_level(logging.WARNING, logger="tasks.train_step"):
                caplog.clear()
                done = member_step(store, MRUN, plan, 0, c, holder=holder, backend="gloo")
            warned = [r.getMessage() for r in caplog.records if r.name == "tasks.train_step"]
            got.append((done.metrics["train/dp_sync"], holder.trainer is kept, warned))
            assert holder.trainer.n_steps == k + 1
            sharded_state = store.exists(f"checkpoints/{MRUN}/v{k + 1}/sharded/.metadata")
            assert sharded_state == (c is fsdp)
            if k == 1:  # the sharded trainer's AdamW starts fresh, as this one's
                ref = Trainer(
                    fetch_checkpoint(store, MRUN, 1), version=1, lr=cfg.lr, max_tokens_per_micro=96
                )
            ref.step(step_order(store, [segs[k]], plan.shuffle_seed), current_version=k)
            _weights_equal(store, k + 1, ref.model, cfg)
        fresh = (
            "v1 has no sharded state (written with train.sharding=replicate?): the sharded "
            "AdamW starts fresh"
        )
        assert got == [
            (2.0, False, []),
            (2.0, False, [fresh]),
            (0.0, True, []),
            (3.0, False, []),
        ]
        # back to train.sharding=replicate: the sharded trainer is no replica, the checkpoint is
        seg4 = append_sessions(store, MRUN, np.random.default_rng(9), ["s40", "s41"], n_calls=4)
        plan = _plan(port, 4, 4, seg4, generation=1)
        done = member_step(store, MRUN, plan, 0, cfg, holder=holder, backend="gloo")
        assert done.metrics["train/dp_sync"] == 2.0 and done.weight_version == 5
        assert not sharded.is_sharded(holder.trainer)
    finally:
        if holder.dp is not None:
            holder.dp.close()
        del server


def test_a_cell_whose_next_group_fails_to_form_forms_the_one_after_at_its_interface(
    tmp_path, monkeypatch
):
    """A cell in a group is sent to a generation of two whose other member never comes: the
    old group is closed and the failure named within the timeout; the cell then forms the
    generation after and commits, gloo told the interface of the cell's worker address (where
    this machine has a routable one)."""
    from tests.tasks.train.test_mut_dp import _routable_address

    monkeypatch.delenv(dp.GLOO_IFNAME, raising=False)
    monkeypatch.delenv("_GYRE_GLOO_FOR", raising=False)
    asked: list[str] = []
    pick = dp.pick_backend
    monkeypatch.setattr(dp, "pick_backend", lambda b="auto": asked.append(b) or pick(b))
    cfg = TrainConfig(lr=1e-3, max_tokens_per_micro=96)
    store, segs = _member_store(tmp_path)
    server, port = dp.host_store("127.0.0.1", timeout_s=60)
    routable = _routable_address()
    holder = SimpleNamespace(  # no trainer_run yet: member_step sets it
        dp=None,
        trainer=None,
        trainer_key=None,
        worker_address=f"tcp://{routable[0] if routable else '127.0.0.1'}:1",
    )
    try:
        first = member_step(
            store, MRUN, _plan(port, 0, 0, segs[0]), 0, cfg, holder=holder, backend="gloo"
        )
        if routable:
            assert os.environ[dp.GLOO_IFNAME] == routable[1]
        alone = replace(_plan(port, 1, 1, segs[1], generation=1), members=("cell-a", "cell-b"))
        with pytest.raises(dp.DPError, match=r"^generation 1: rank 0 of 2 could not form"):
            member_step(store, MRUN, alone, 0, cfg, holder=holder, backend="gloo", timeout_s=1)
        assert holder.dp is None and first.weight_version == 1
        eight = append_sessions(
            store, MRUN, np.random.default_rng(5), [f"e{i}" for i in range(8)], n_calls=3
        )
        plan = _plan(port, 1, 1, eight, generation=2)
        done = member_step(
            store,
            MRUN,
            plan,
            0,
            cfg.model_copy(update={"context_parallel_tokens": 8}),
            holder=holder,
            backend="gloo",
        )
        assert done.weight_version == 2 and holder.dp.rv.generation == 2
        # long samples, but a member alone trains them whole: none context parallel
        assert max(s.n_tokens for s in load_samples(store, eight)) > 8
        assert done.metrics["train/context_parallel_samples"] == 0.0
        # the ledger in the batch's order: by id, shuffled by the plan's seed (1 in 8! by chance)
        ledger = committed_steps(store, MRUN)[-1]["ledger"]
        assert [r["sample_id"] for r in ledger] == [
            s.sample_id for s in step_order(store, [eight], plan.shuffle_seed)
        ]
        # a step with no samples (nothing arrived): a version all the same, reward 0
        empty = replace(_plan(port, 2, 2, eight, generation=2), segments=())
        none = member_step(store, MRUN, empty, 0, cfg, holder=holder, backend="gloo")
        assert none.weight_version == 3 and none.metrics["train/reward_mean"] == 0.0
        assert committed_steps(store, MRUN)[-1]["ledger"] == []
        assert asked == ["gloo"] * 3  # the backend the caller named, at each formation
    finally:
        if holder.dp is not None:
            holder.dp.close()
        del server


def test_a_sharded_trainer_with_kl_gets_the_warm_start_as_reference(tmp_path):
    """``restore_sharded`` with ``kl_coef > 0`` (one member in the test process): the KL
    reference is this run's v0 checkpoint, its weights exactly the warm start's."""
    store, segs = _member_store(tmp_path)
    server, port = dp.host_store("127.0.0.1", timeout_s=60)
    group = dp.DPGroup(_plan(port, 0, 0, segs[0]).rendezvous(0), backend="gloo", timeout_s=60)
    try:
        cfg = TrainConfig(max_tokens_per_micro=96, kl_coef=0.1, sharding="fsdp")
        trainer, how = restore_sharded(store, MRUN, 0, cfg, group)
        assert how == "checkpoint"
        assert trainer.ref_model_dir == fetch_checkpoint(store, MRUN, 0)
        warm = restore_trainer(store, MRUN, 0, TrainConfig()).model.state_dict()
        for name, t in trainer.ref_model.state_dict().items():
            assert torch.equal(t, warm[name]), name
    finally:
        group.close()
        del server


# -- the small helpers, from their definitions ------------------------------------------------


def _drop_sample(versions, reward: float = 1.0, prune: bool = False):
    (s,) = build_samples(
        [small_tree(versions=versions)], {"s": reward}, advantage="reward", prune=prune
    )
    return s


def test_sample_lag_is_the_policy_tokens_lag_and_none_without_them():
    s = _drop_sample((0, 2, 2, 2))
    v = s.versions[s.versions >= 0]
    mean, mx, n = sample_lag(s, 3)
    assert (mean, mx, n) == (pytest.approx(float((3 - v).mean())), int((3 - v).max()), v.size)
    assert mx == 3 and n > 0  # the v0 tokens, 3 versions back
    mean, mx, n = sample_lag(_drop_sample((-1, -1, -1, -1)), 3)
    assert np.isnan(mean) and (mx, n) == (-1, 0)


def test_one_stale_token_is_dropped_and_counts_stay_int32():
    s = _drop_sample((2, 2, 2, 2))
    i = int(np.flatnonzero((s.counts > 0) & (s.versions >= 0))[0])
    versions = s.versions.copy()
    versions[i] = 0
    got, n = drop_stale(replace(s, versions=versions), 3, 1)
    assert n == 1 and got.counts[i] == 0 and got.weight_pos[i] == 0
    assert got.n_trainable == s.n_trainable - 1 and got.counts.dtype == np.int32


def test_a_zero_advantage_samples_stale_tokens_leave_its_normaliser():
    # reward 0: every token's weight is 0 (not in the trainable mask), yet its branches still
    # count it in the normaliser: a stale one must leave counts and normaliser, the others stay
    s = _drop_sample((0, 2, 2, 2), reward=0.0)
    assert not s.trainable_mask.any() and s.counts.sum() == s.n_flat_trainable > 0
    got, n = drop_stale(s, 3, 1)
    stale = (s.versions >= 0) & (s.versions < 2) & (s.counts > 0)
    assert n == int(stale.sum()) > 0
    assert got.n_flat_trainable == s.n_flat_trainable - int(s.counts[stale].sum()) > 0
    assert np.array_equal(got.counts, np.where(stale, 0, s.counts))


def test_trainer_kwargs_follow_the_stale_policy_and_the_sampling_defaults():
    base = TrainConfig(max_staleness=3)
    assert _trainer_kwargs(base.model_copy(update={"stale_policy": "is"}))["max_staleness"] == 3
    assert (
        _trainer_kwargs(base.model_copy(update={"stale_policy": "drop"}))["max_staleness"] is None
    )
    plain = _trainer_kwargs(base)
    assert (plain["temperature"], plain["top_p"]) == (1.0, 1.0)
    set_ = _trainer_kwargs(base.model_copy(update={"temperature": 0.7, "top_p": 0.9}))
    assert (set_["temperature"], set_["top_p"]) == (0.7, 0.9)


def test_a_crashed_commits_rows_are_rolled_forward_before_the_ledger_is_checked(tmp_path):
    """A step committed (its marker) whose ledger/steps rows a crash lost: the check redoes
    them first, so its samples are still refused; the message names the first one; another
    run's ledger does not count."""
    import shutil

    from tasks.train_step import _check_ledger

    store = Store(str(tmp_path / "store"))
    (policy,) = build_samples([small_tree("s", (0, 2, 2, 2))], {"s": 1.0}, advantage="reward")
    (copied,) = build_samples([small_tree("t", (-1, -1, -1, -1))], {"t": 1.0}, advantage="reward")
    commit_step(
        store, "r1", 0, _Saver(version=1), 0, [policy, copied], METRICS, members=("a",), t_start=0
    )
    for ds in ("ledger", "steps"):
        shutil.rmtree(tmp_path / "store" / ds)
    assert store.read("ledger").num_rows == 0
    with pytest.raises(LedgerError) as err:
        _check_ledger(store, "r1", 5, [copied, policy])
    assert str(err.value) == f"step 5: 2 samples already trained, e.g. {copied.sample_id!r}"
    assert store.read("ledger").num_rows == 2  # rolled forward
    _check_ledger(store, "r2", 0, [policy])  # another run's samples of the same ids: fine


def test_the_cells_replica_is_kept_between_steps_and_restored_with_its_optimizer(tmp_path):
    """``get_trainer`` with a holder: loaded once, kept while its key is the newest version;
    ``train_on_samples`` moves the key to the version it committed; without a holder each
    call loads anew; with no checkpoint the error says where. ``restore_trainer`` brings back
    the committed AdamW state, counters, settings and (kl_coef > 0) the warm start as the KL
    reference. A replayed batch is refused by step; a step without a segment trains none."""
    from infra.engine.tiny_model import make_tiny_model
    from tasks.train_step import get_trainer, train_on_samples

    store = Store(str(tmp_path / "store"))
    cfg = TrainConfig(lr=2e-3, kl_coef=0.1)
    with pytest.raises(FileNotFoundError) as err:
        get_trainer(store, "r1", cfg)
    assert str(err.value) == f"no checkpoint in {store.url}: publish v0 before training"
    publish_checkpoint(store, "r1", make_tiny_model(), 0)
    holder = SimpleNamespace(trainer=None, trainer_key=None)
    t0 = get_trainer(store, "r1", cfg, holder)
    assert holder.trainer is t0 and holder.trainer_key == (store.url, "r1", 0)
    assert get_trainer(store, "r1", cfg, holder) is t0
    assert get_trainer(store, "r1", cfg) is not t0

    samples = build_samples([small_tree("s", (0, 0, 0, 0))], {"s": 1.0}, advantage="reward")
    seg = store.append("samples", [smp.to_row() for smp in samples])
    done = train_on_samples(store, "r1", 0, seg, cfg, holder=holder)
    assert done.weight_version == 1 and holder.trainer is t0 and t0.version == 1
    assert holder.trainer_key == (store.url, "r1", 1)
    assert get_trainer(store, "r1", cfg, holder) is t0  # kept: no reload of its own commit

    back = restore_trainer(store, "r1", 1, cfg)
    assert back.version == 1 and back.n_steps == t0.n_steps == 1 and back.lr == 2e-3
    assert back.ref_model_dir == fetch_checkpoint(store, "r1", 0)
    mine = t0.optimizer.state_dict()["state"]
    got = back.optimizer.state_dict()["state"]
    assert mine and got.keys() == mine.keys()
    for k, st in mine.items():
        assert torch.equal(got[k]["exp_avg"], st["exp_avg"]), k

    with pytest.raises(LedgerError, match=r"^step 1: 1 samples already trained"):
        train_on_samples(store, "r1", 1, seg, cfg, holder=holder)
    empty = train_on_samples(store, "r1", 1, None, cfg, holder=holder)
    assert empty.weight_version == 2 and committed_steps(store, "r1")[-1]["ledger"] == []


def test_a_replica_restored_from_an_object_store_has_its_adamw_state_and_asked_version(tmp_path):
    """``restore_trainer`` from a store that is not local (fetched into the host's cache, not
    read in place): the committed AdamW moments come back, even when the host's engine
    fetched that version's weights first; and the version is the one asked for even where
    the checkpoint records none (a plain model directory)."""
    import uuid

    from infra.engine.tiny_model import make_tiny_model
    from storage.checkpoints import commit_checkpoint
    from tasks.train_step import train_on_samples

    cfg = TrainConfig(lr=2e-3)
    local = Store(str(tmp_path / "store"))
    publish_checkpoint(local, "r1", make_tiny_model(), 0)
    samples = build_samples([small_tree("s", (0, 0, 0, 0))], {"s": 1.0}, advantage="reward")
    holder = SimpleNamespace(trainer=None, trainer_key=None)
    seg = local.append("samples", [smp.to_row() for smp in samples])
    train_on_samples(local, "r1", 0, seg, cfg, holder=holder)
    remote = Store(f"memory://gyre-mut-ts-{uuid.uuid4().hex}")
    for v, src in ((1, fetch_checkpoint(local, "r1", 1)), (3, make_tiny_model())):
        stage_checkpoint(remote, "r1", src, v)
        commit_checkpoint(remote, "r1", v)
    fetch_checkpoint(remote, "r1", 1)  # the engine's weights-only copy, first
    back = restore_trainer(remote, "r1", 1, cfg)
    mine = holder.trainer.optimizer.state_dict()["state"]
    got = back.optimizer.state_dict()["state"]
    assert mine and got.keys() == mine.keys()
    for k, st in mine.items():
        assert torch.equal(got[k]["exp_avg_sq"], st["exp_avg_sq"]), k
    assert back.version == 1 and back.n_steps == 1
    assert restore_trainer(remote, "r1", 3, cfg).version == 3


def test_member_on_cell_uses_the_cells_plugin_to_hold_group_and_replica(tmp_path):
    """``member_on_cell`` as a Dask task on a real cell (an in-process worker, so the test
    process runs it): the step is committed with what it was given, and the cell's plugin
    holds the group and the replica the next step keeps."""
    from distributed import Client, LocalCluster

    from infra.cells.cluster import PLUGIN_NAME, CellPlugin
    from tasks.train_step import member_on_cell

    # stale_policy=is: the samples reach the trainer as they are (no drop)
    cfg = TrainConfig(lr=1e-3, max_tokens_per_micro=96, max_staleness=8, stale_policy="is")
    store, segs = _member_store(tmp_path)
    server, port = dp.host_store("127.0.0.1", timeout_s=60)
    threads = torch.get_num_threads()
    plugin = None
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None
        ) as cl,
        Client(cl) as client,
    ):
        try:
            client.register_plugin(CellPlugin())
            (worker,) = cl.workers.values()
            plugin = worker.plugins[PLUGIN_NAME]
            kw = {"backend": "gloo", "mode": "elastic", "timeout_s": 60.0}
            d0 = client.submit(
                member_on_cell, store, MRUN, _plan(port, 0, 0, segs[0]), 0, cfg, **kw
            )
            d0 = d0.result(timeout=120)
            replica, group = plugin.trainer, plugin.dp
            assert replica.version == 1 and group.rv == _plan(port, 0, 0, segs[0]).rendezvous(0)
            d1 = client.submit(
                member_on_cell, store, MRUN, _plan(port, 1, 1, segs[1]), 0, cfg, **kw
            ).result(timeout=120)
            assert plugin.trainer is replica and plugin.dp is group
            assert (d0.metrics["train/dp_sync"], d1.metrics["train/dp_sync"]) == (2.0, 0.0)
            assert (d0.step, d1.step, d1.weight_version) == (0, 1, 2)
            rows = [rec["steps"] for rec in committed_steps(store, MRUN)]
            assert [(r["step"], r["mode"], r["cells"]) for r in rows] == [
                (0, "elastic", ["cell-a"]),
                (1, "elastic", ["cell-a"]),
            ]
        finally:
            if plugin is not None and plugin.dp is not None:
                plugin.dp.close()
            torch.set_num_threads(threads)
            del server


def test_a_sample_the_sampler_already_dropped_from_loses_nothing_more():
    """The sampler's drop (``max_staleness`` at build time) leaves its stale tokens untrained
    and uncounted; the step's drop at the same bound finds nothing left to drop."""
    tree = small_tree(versions=(0, 2, 2, 2))
    (s,) = build_samples(
        [tree], {"s": 1.0}, advantage="reward", prune=False, current_version=3, max_staleness=1
    )
    assert ((s.versions == 0) & (s.counts == 0)).any()  # dropped by the sampler
    got, n = drop_stale(s, 3, 1)
    assert n == 0 and got is s
