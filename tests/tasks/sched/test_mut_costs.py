"""The cost model (tasks/sched/costs.py) where generated mutants survived its other fast
tests (bench/mutation.py): one member is a valid step, each bad guess is refused on its own,
measurements under a second count, ``learn=False`` learns nothing, and a singular system
has no step model (all zeros)."""

from __future__ import annotations

import pytest

from tasks.sched.costs import CostEstimator, Costs, _solve


def test_one_member_is_a_step_and_none_is_not():
    c = Costs(train_s_per_sample=0.5, dp_sync_s=0.25, regroup_s=3.0)
    assert c.step_seconds(8, 1) == 8 * 0.5 + 0.25
    assert c.step_seconds(8, 2, regroup=True) == 8 * 0.5 / 2 + 0.5 + 3.0
    with pytest.raises(ValueError, match="at least one member"):
        c.step_seconds(8, 0)


@pytest.mark.parametrize(
    "guess", [(0.0, 0.1, 0.0), (1.0, -0.1, 0.0), (1.0, 0.1, -1.0), (-1.0, 0.1, 0.0)]
)
def test_each_bad_guess_is_refused_alone(guess):
    a, b, r = guess
    with pytest.raises(ValueError, match="cost guesses"):
        CostEstimator(a, b, r)


def test_measurements_under_a_second_are_learned():
    est = CostEstimator(train_s_per_sample=1.0, dp_sync_s=0.1)
    est.step(samples=4, members=1, seconds=0.4)
    est.to_rollout(0.5)
    est.weight_load(0.25)
    est.drain(0.75)
    c = est.snapshot()
    assert c.steps == 1 and c.sizes == (1,)
    assert c.train_s_per_sample < 1.0  # a 0.4 s step pulled the 1 s/sample guess down
    assert (c.to_rollout_s, c.weight_load_s, c.drain_s) == (0.5, 0.25, 0.75)


def test_learn_false_keeps_the_guesses():
    est = CostEstimator(train_s_per_sample=1.0, dp_sync_s=0.1, learn=False)
    est.step(samples=4, members=1, seconds=40.0)
    est.to_rollout(5.0)
    est.weight_load(2.0)
    est.drain(3.0)
    c = est.snapshot()
    assert (c.train_s_per_sample, c.dp_sync_s, c.steps) == (1.0, 0.1, 0)
    assert (c.to_rollout_s, c.weight_load_s, c.drain_s) == (None, None, None)


def test_solve_is_exact_and_a_singular_system_gives_zeros():
    assert _solve([[2.0, 0.0], [0.0, 4.0]], [2.0, 8.0]) == [1.0, 2.0]
    assert _solve([[1.0, 2.0], [2.0, 4.0]], [1.0, 2.0]) == [0.0, 0.0]
