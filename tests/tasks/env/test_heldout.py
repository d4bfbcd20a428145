"""Held-out seeds, evaluation versions and the standard error (tasks/env/heldout.py)."""

from __future__ import annotations

import math

import pytest

from flows.config import ConfigError, load_config
from flows.schedule import PrefectWork
from tasks.env.heldout import (
    EVAL_SEED0,
    EvalConfig,
    eval_seeds,
    eval_versions,
    mean_and_se,
    seed_overlap,
    train_task_seed,
)
from tasks.env.tools import ToolsSuite


def test_a_negative_seed_draws_the_same_task_as_its_absolute_value():
    # why negative seeds are not held out: CPython seeds random.Random by abs(seed)
    suite = ToolsSuite(subtasks=3, difficulty=1)
    assert suite.task(-1009).data == suite.task(1009).data
    assert suite.task(-1009).task_id != suite.task(1009).task_id  # only the name differs


def test_seed_overlap_hand_cases():
    # rollout.seed 0 trains on 0, 1009, 2018, ... (groups 0, 1, 2, ...)
    assert seed_overlap([0], 0, 1) == [0]
    assert seed_overlap([2018], 0, 2) == []  # group 2 is never started with 2 groups
    assert seed_overlap([2018], 0, 3) == [2018]
    assert seed_overlap([-2018, 2017], 0, 3) == [-2018]  # by absolute value
    # rollout.seed 1 trains on 1_000_003 + 1009 k
    assert seed_overlap([1_000_003 + 1009 * 5], 1, 10) == [1_000_003 + 1009 * 5]
    assert seed_overlap([1_000_003 + 1009 * 5 + 1], 1, 10) == []
    # rollout.seed -1 trains on -1_000_003 + 1009 k: |.| of those hits positives
    assert seed_overlap([1_000_003 - 1009], -1, 2) == [1_000_003 - 1009]
    # a demonstration range
    assert seed_overlap([50, 51], 7, 1, [range(51, 60)]) == [51]
    # the defaults are far from anything a run of any reasonable length draws
    seeds = eval_seeds(EvalConfig(tasks=1000))
    assert seeds[0] == EVAL_SEED0 and len(set(seeds)) == 1000
    for rollout_seed in (-3, 0, 1, 42, 10_000):
        assert seed_overlap(seeds, rollout_seed, 10**6) == []


def test_training_seeds_are_the_ones_the_scheduling_flow_derives():
    cfg = load_config(preset="tiny", overrides=["rollout.seed=7"])
    work = PrefectWork("r", cfg, None, None, "stop")
    for index in (0, 1, 5, 123):
        assert work.spec(index).task_seed == train_task_seed(7, index)


def test_eval_versions():
    assert eval_versions(10, 4) == [0, 4, 8, 10]
    assert eval_versions(8, 4) == [0, 4, 8]
    assert eval_versions(3, 1) == [0, 1, 2, 3]
    assert eval_versions(3, 10) == [0, 3]
    assert eval_versions(5, 0) == []


def test_mean_and_standard_error_by_hand():
    assert mean_and_se([]) == (0.0, 0.0)
    assert mean_and_se([0.7]) == (0.7, 0.0)
    m, se = mean_and_se([1.0, 0.0])  # sample var 0.5, se = sqrt(0.5 / 2) = 0.5
    assert m == 0.5 and se == pytest.approx(0.5)
    m, se = mean_and_se([0.5, 0.5, 0.5, 1.0])  # var = 0.1875 / 3, se = sqrt(var / 4)
    assert m == 0.625 and se == pytest.approx(math.sqrt(0.0625 / 4))


def test_config_refuses_held_out_seeds_that_training_draws():
    with pytest.raises(ConfigError) as ei:
        load_config(preset="tiny", overrides=["eval.every=1", "eval.seed0=-1009", "eval.tasks=2"])
    assert "eval.seed0=-1009" in str(ei.value) and "abs" in str(ei.value)
    # evaluation off: no check needed
    load_config(preset="tiny", overrides=["eval.every=0", "eval.seed0=-1009"])


def test_config_refuses_a_warm_start_it_cannot_build():
    with pytest.raises(ConfigError) as ei:
        load_config(preset="tiny", overrides=["warmstart.enabled=true", "rollout.suite=arith"])
    assert "no demonstrations" in str(ei.value)
    # a warm start of a given checkpoint is one it can build (tests/flows/test_model_path.py)
    load_config(
        preset="tiny", overrides=["warmstart.enabled=true", "rollout.suite=tools", "model.path=/x"]
    )
