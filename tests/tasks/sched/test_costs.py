"""The policy's cost model learns step, regroup, drain and load costs from the run."""

import dataclasses
import random

import pytest

from tasks.sched import presets
from tasks.sched.coordinator import (
    Coordinator,
    Move,
    MoveDone,
    RolloutFinished,
    StartRollouts,
    StartStep,
    StepFinished,
    Tick,
    WeightsLoaded,
)
from tasks.sched.costs import CostEstimator
from tasks.sched.simulator import simulate
from tasks.sched.waterlevel import best_members
from tasks.sched.workload import Workload


def true_step(samples, m, regroup, a=1.0, b=2.0, r=9.0):
    return samples * a / m + b * m + (r if regroup else 0.0)


def test_converges_to_the_true_costs_from_a_wrong_guess():
    rng = random.Random(0)
    est = CostEstimator(train_s_per_sample=0.2, dp_sync_s=0.4, learn_regroup=True)  # 5x off
    for _ in range(30):
        m, regroup = rng.choice([4, 8, 16, 24]), rng.random() < 0.5
        est.step(128, m, true_step(128, m, regroup), regroup)
    c = est.snapshot()
    assert c.steps == 30
    assert c.train_s_per_sample == pytest.approx(1.0, rel=0.05)
    assert c.dp_sync_s == pytest.approx(2.0, rel=0.05)
    assert c.regroup_s == pytest.approx(9.0, rel=0.1)
    assert c.step_seconds(128, 8, True) == pytest.approx(true_step(128, 8, True), rel=0.03)


def test_one_member_count_sets_the_scale_and_keeps_the_guess_shape():
    """A run that always steps on 8 members: the time at 8 is learnt within a few steps;
    how it splits between per-sample and per-member cost keeps the guess's ratio, so the
    best member count does not jump on one point."""
    est = CostEstimator(train_s_per_sample=0.2, dp_sync_s=0.4)
    for _ in range(4):
        est.step(128, 8, true_step(128, 8, False))
    c = est.snapshot()
    assert c.step_seconds(128, 8) == pytest.approx(true_step(128, 8, False), rel=0.05)
    guess = best_members(128, 0.2, 0.4, 64)
    assert best_members(128, c.train_s_per_sample, c.dp_sync_s, 64) == guess


def test_follows_a_cost_that_grows():
    """Training that grows 4 % per step (rollouts lengthen): the estimate stays within
    about two steps' growth of it."""
    est = CostEstimator(train_s_per_sample=1.0, dp_sync_s=2.0)
    a = 1.0
    rng = random.Random(1)
    for _ in range(40):
        a *= 1.04
        m = rng.choice([6, 8, 10])
        est.step(128, m, true_step(128, m, False, a=a))
    assert est.snapshot().train_s_per_sample == pytest.approx(a, rel=0.1)


def test_learn_off_keeps_the_guess():
    est = CostEstimator(train_s_per_sample=0.2, dp_sync_s=0.4, learn=False)
    est.step(128, 8, 100.0)
    est.drain(30.0)
    c = est.snapshot()
    assert (c.train_s_per_sample, c.dp_sync_s, c.steps, c.drain_s) == (0.2, 0.4, 0, None)


def test_moves_and_loads_are_smoothed_means():
    est = CostEstimator(1.0, 1.0, smooth=0.5)
    est.drain(10.0)
    est.drain(20.0)
    est.to_rollout(90.0)
    est.weight_load(30.0)
    c = est.snapshot()
    assert (c.drain_s, c.to_rollout_s, c.weight_load_s) == (15.0, 90.0, 30.0)


class Script:
    """Cell 0 rolls out; cell 1 trains one step, goes to rollout, comes back, trains."""

    name = "script"
    train_s_per_sample = 0.5
    dp_sync_s = 1.0

    def __init__(self):
        self.plan = []

    def initial_roles(self, n):
        return ("rollout", "train", "train")

    def recommendations(self, s):
        return self.plan.pop(0) if self.plan else []


def test_coordinator_feeds_the_estimator_from_events():
    pol = Script()
    co = Coordinator(pol, 3, 4)
    assert co.state().costs.train_s_per_sample == 0.5 and co.state().costs.steps == 0
    pol.plan = [[StartRollouts(0, 4)], [StartStep((1, 2), 4)], [Move(1, "rollout")]]
    co.handle(Tick(0.0))
    for i in range(4):
        co.handle(RolloutFinished(0, i))
    co.handle(Tick(10.0))
    co.handle(StepFinished((1, 2), seconds=24.0))  # 4 * a / 2 + b * 2 = 24
    co.handle(Tick(30.0))
    co.handle(MoveDone(1, seconds=95.0))
    c = co.state().costs
    assert c.steps == 1 and c.step_seconds(4, 2) == pytest.approx(24.0, rel=0.05)
    assert c.to_rollout_s == 95.0 and c.drain_s is None
    # no seconds from the executor: timed on the coordinator's clock (ticks)
    pol.plan = [[Move(1, "train")]]
    co.handle(Tick(200.0))
    co.handle(Tick(260.0))
    co.handle(MoveDone(1))
    assert co.state().costs.drain_s == 60.0
    co.handle(WeightsLoaded(0, 1, seconds=31.0))  # a load it did not order: still a time
    assert co.state().costs.weight_load_s == 31.0
    # the executor's measured seconds are not part of an event's equality
    assert MoveDone(1, seconds=3.0) == MoveDone(1)


def test_calibrate_off_freezes_the_costs():
    pol = Script()
    co = Coordinator(pol, 3, 4, calibrate=False)
    pol.plan = [[StartRollouts(0, 4)], [StartStep((1, 2), 4)]]
    co.handle(Tick(0.0))
    for i in range(4):
        co.handle(RolloutFinished(0, i))
    co.handle(Tick(10.0))
    co.handle(StepFinished((1, 2), seconds=240.0))
    assert co.state().costs.train_s_per_sample == 0.5


GROWTH = Workload(
    name="growth-small",
    cells=16,
    cap=4,
    batch=64,
    steps=24,
    median_s=300.0,
    growth=12.0,
    train_s_per_sample=20.0,
    train_follows_length=True,
    dp_sync_s=10.0,
)


def test_simulated_run_with_costs_5x_wrong_nears_the_right_one():
    """Elastic told a sample trains 5x faster and DP costs 5x more than they do (so it
    staffs steps with too few members), on a workload whose training grows with rollout
    length: calibrated from the run's own steps it gets near the run told the right
    start costs (within 10 %: the per-sample cost swings with which rollouts a step
    trains, so the fit is noisy); with its guesses frozen it loses 15 %."""
    w = GROWTH
    wrong = dataclasses.replace(
        w, train_s_per_sample=w.train_s_per_sample / 5, dp_sync_s=w.dp_sync_s * 5
    )
    right = simulate(presets.elastic(w), w, seed=0)["samples_per_hour"]
    learnt = simulate(presets.elastic(wrong), w, seed=0)["samples_per_hour"]
    frozen = simulate(presets.elastic(wrong), w, seed=0, calibrate=False)["samples_per_hour"]
    assert learnt >= 0.9 * right
    assert frozen < 0.87 * right
