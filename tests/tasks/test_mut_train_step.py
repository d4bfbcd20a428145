"""What a committed step records (``commit_step`` in tasks/train_step.py), where generated
mutants survived the other fast tests (bench/mutation.py): each ledger row's lag (a number
for a sample with policy tokens, null for one without), the steps row's dropped tokens, the
same in the commit record as in the datasets; and what a step run without a cell
(``train_on_samples``: tests, tools) records as its cell and its start."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from storage.checkpoints import stage_checkpoint
from storage.commits import committed_steps
from storage.store import Store
from tasks.train_step import commit_step, sample_lag
from tasks.trajectory.sampler import build_samples
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


def test_a_restored_trainer_with_kl_gets_the_warm_start_as_reference(tmp_path):
    from storage.checkpoints import commit_checkpoint, fetch_checkpoint
    from tasks.train.config import TrainConfig
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
    from storage.checkpoints import publish_checkpoint
    from tasks.train.config import TrainConfig
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
