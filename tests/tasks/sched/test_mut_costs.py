"""The cost model (tasks/sched/costs.py) where generated mutants survived its other fast
tests (bench/mutation.py): one member is a valid step, each bad guess is refused on its own,
measurements under a second count, ``learn=False`` learns nothing, and a singular system
has no step model (all zeros)."""

from __future__ import annotations

import itertools
import math

import numpy as np
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


# -- the whole generated set (bench/mutation.py --sample 0: 345 mutants, 48 survived the
# fast tests); each test below is written from the module text, not from the code


def ridge(steps, prior, w, forget):
    """The fit the module text describes, by numpy: least squares over ``(samples / members,
    members) -> seconds``, step ``i`` of ``n`` weighted ``forget ** (n - 1 - i)``, plus ``w_k
    (theta_k - prior_k) ** 2``; a negative coefficient fixed at 0 and the rest refitted."""
    x = np.array([[s / m, float(m)] for s, m, _ in steps])
    y = np.array([t for _, _, t in steps])
    g = forget ** np.arange(len(steps))[::-1]
    free = [0, 1]
    theta = np.zeros(2)
    while free:
        xf = x[:, free]
        a = xf.T @ (g[:, None] * xf) + np.diag([w[k] for k in free])
        b = xf.T @ (g * y) + np.array([w[k] * prior[k] for k in free])
        sol = np.linalg.solve(a, b)
        if (sol >= 0).all():
            theta[free] = sol
            break
        free = [k for k, v in zip(free, sol, strict=True) if v >= 0]
    return theta


def prior_weights(est, first):
    """The prior's weight per coefficient (module text: about ``prior_weight`` of one step,
    the guess's shape kept; a zero guess pulls as a guess of 1 % of the step would)."""
    s, m, _ = first
    x0, m0 = s / m, float(m)
    p = (est.train_s_per_sample, est.dp_sync_s)
    y0 = x0 * p[0] + m0 * p[1]
    return [
        est.prior_weight * x0 * y0 / max(p[0], 0.01 * y0 / x0),
        est.prior_weight * m0 * y0 / max(p[1], 0.01 * y0 / m0),
    ]


def snap(est, steps, **kw):
    for s, m, t in steps:
        est.step(s, m, t, **kw)
    return est.snapshot()


@pytest.mark.parametrize(
    "guess, steps",
    [
        # a per-sample guess under 1 % of the step: its prior weight from the 1 % floor
        ((1e-4, 1.0), [(8, 2, 3.0), (8, 4, 2.0), (16, 2, 5.5), (8, 1, 4.5)]),
        # a zero per-member guess: its prior weight from the 1 % floor
        ((0.5, 0.0), [(8, 2, 3.0), (8, 4, 2.0), (16, 2, 5.5), (8, 1, 4.5)]),
        # time falls with the per-member work: the per-sample cost fits negative -> 0
        ((0.5, 0.2), [(4, 1, 9.0), (8, 1, 6.0), (16, 1, 3.0), (32, 1, 1.0), (8, 2, 7.0)]),
        # time falls with members: the per-member cost fits negative -> 0, a refitted
        ((0.2, 1.0), [(8, 1, 12.0), (8, 2, 6.0), (8, 4, 1.0), (16, 4, 2.0)]),
    ],
)
def test_the_fit_is_weighted_least_squares_with_the_prior_and_no_negative_cost(guess, steps):
    est = CostEstimator(*guess, max_drift=0.0)  # no trend: the snapshot is the fit itself
    got = snap(est, steps)
    want = ridge(steps, guess, prior_weights(est, steps[0]), est.forget)
    want[0] = max(want[0], 1e-3 * guess[0])  # a sample always costs something
    assert (got.train_s_per_sample, got.dp_sync_s) == pytest.approx(tuple(want), rel=1e-9)
    assert got.train_s_per_sample > 0 and got.dp_sync_s >= 0


def test_a_per_sample_cost_fitted_at_zero_is_a_thousandth_of_the_guess():
    steps = [(4, 1, 9.0), (8, 1, 6.0), (16, 1, 3.0), (32, 1, 1.0)]  # more work, less time
    got = snap(CostEstimator(2.0, 0.2, max_drift=0.0), steps)
    assert got.train_s_per_sample == pytest.approx(2e-3)


@pytest.mark.parametrize("forget", [1e-9, 0.5, 1.0])
def test_forget_in_zero_one_is_accepted(forget):
    CostEstimator(0.5, 0.1, forget=forget).snapshot()


@pytest.mark.parametrize("forget", [0.0, -0.1, 1.0 + 1e-9, 1.5])
def test_forget_outside_zero_one_is_refused_naming_it(forget):
    with pytest.raises(ValueError, match=rf"forget must be in \(0, 1\], got {forget}"):
        CostEstimator(0.5, 0.1, forget=forget)


def test_a_free_dp_sync_guess_is_valid():
    assert CostEstimator(0.5, 0.0).snapshot().dp_sync_s == 0.0


def test_each_bad_step_is_ignored_alone_and_a_zero_second_or_one_sample_step_learned():
    for samples, members, seconds in [(0, 2, 3.0), (4, 0, 3.0), (4, 2, -1.0), (4, 2, math.nan)]:
        est = CostEstimator(0.5, 0.1)
        est.step(samples, members, seconds)
        assert est.snapshot().steps == 0, (samples, members, seconds)
    for samples, seconds in [(1, 2.0), (4, 0.0)]:
        est = CostEstimator(0.5, 0.1)
        est.step(samples, 1, seconds)
        assert est.snapshot().steps == 1, (samples, seconds)


def test_a_step_is_not_regrouped_unless_said():
    steps = [(8, 2, 5.0), (8, 2, 5.5)]
    said = snap(CostEstimator(0.5, 0.1, regroup_s=2.0), steps, regrouped=False)
    default = snap(CostEstimator(0.5, 0.1, regroup_s=2.0), steps)
    assert default == said


def test_the_first_four_member_counts_are_kept():
    est = CostEstimator(0.5, 0.1)
    for m in (3, 1, 6, 2, 5, 4):
        est.step(12, m, 4.0)
    assert est.snapshot().sizes == (1, 2, 3, 6)


@pytest.mark.parametrize("verb, field", [("drain", "drain_s"), ("to_rollout", "to_rollout_s"), ("weight_load", "weight_load_s")])  # fmt: skip
def test_move_costs_are_a_smoothed_mean_from_zero_seconds_on(verb, field):
    est = CostEstimator(0.5, 0.1, smooth=0.3)
    getattr(est, verb)(0.0)
    assert getattr(est.snapshot(), field) == 0.0  # a 0 s measurement is one
    getattr(est, verb)(2.0)
    getattr(est, verb)(1.0)
    # exponential smoothing from the first: 0 -> 0 + 0.3 * 2 = 0.6 -> 0.6 + 0.3 * 0.4
    assert getattr(est.snapshot(), field) == pytest.approx(0.72)


def trend_reference(steps, forget, smooth, max_drift, guess=(0.5, 0.1)):
    """The module text's trend: after each step from the second, the log change of the fit's
    prediction at the first step's size, clamped to +-max_drift and exponentially smoothed
    from 0; the snapshot carries both coefficients forward by ``exp(trend / (1 - forget))``
    (the fit is about that many steps old), ``exp(trend)`` when nothing is forgotten. The
    fit after each step is read from an estimator with no trend (``max_drift=0``)."""
    plain = CostEstimator(*guess, forget=forget, max_drift=0.0)
    s0, m0, _ = steps[0]
    at = []
    for s, m, t in steps:
        plain.step(s, m, t)
        c = plain.snapshot()
        at.append(c.train_s_per_sample * s0 / m0 + c.dp_sync_s * m0)
    drift = 0.0
    for a, b in itertools.pairwise(at):
        d = max(-max_drift, min(max_drift, math.log(b / a)))
        drift += smooth * (d - drift)
    ahead = math.exp(drift / (1.0 - forget) if forget < 1 else drift)
    return plain.snapshot(), ahead


@pytest.mark.parametrize(
    "forget, steps",
    [
        # sub-second steps growing 4 % a step, first on 2 members (the size the trend is read at)
        (0.85, [(8, 2, 0.2 * 1.04**k) for k in range(6)]),
        (0.85, [(6, 2, 0.5), (6, 3, 0.45), (12, 2, 0.6), (6, 2, 0.55)]),
        (1.0, [(8, 2, 0.3 * 2.0**k) for k in range(4)]),  # fast growth: clamped
        (0.85, [(8, 2, 5.0), (8, 2, 6.0)]),  # the trend moves from the second step on
    ],
)
def test_the_trend_carries_both_coefficients_forward_by_the_same_factor(forget, steps):
    fit, ahead = trend_reference(steps, forget, smooth=0.3, max_drift=0.1)
    got = snap(CostEstimator(0.5, 0.1, forget=forget, smooth=0.3, max_drift=0.1), steps)
    assert ahead != pytest.approx(1.0, abs=1e-3)
    assert got.train_s_per_sample == pytest.approx(fit.train_s_per_sample * ahead, rel=1e-9)
    assert got.dp_sync_s == pytest.approx(fit.dp_sync_s * ahead, rel=1e-9)


def test_the_regroup_cost_is_the_smoothed_extra_of_regrouped_steps():
    est = CostEstimator(0.5, 0.1, learn_regroup=True, smooth=0.3)
    est.step(8, 2, 2.2, regrouped=True)  # the first step regroups: no comparison yet
    assert est.snapshot().regroup_s == 0.0
    plain = [(8, 2, 0.5 * 4 + 0.1 * 2)] * 6  # exactly the guess
    for s, m, t in plain:
        est.step(s, m, t)
    assert est.snapshot().regroup_s == pytest.approx(0.0, abs=0.05)  # extra 0: never 1 s


def test_the_regroup_cost_follows_regrouped_steps_extra_smoothed_not_the_last():
    """Regrouped steps costing 2, then 4, then 4 s over steps the guess predicts exactly:
    the estimate rises each time and stays under the extra (a smoothed mean less the plain
    steps' residual, with the fit absorbing part of each extra), never the last extra."""
    est = CostEstimator(0.5, 0.1, learn_regroup=True, smooth=0.3)
    for _ in range(6):
        est.step(8, 2, 2.2)
    seen = []
    for extra in (2.0, 4.0, 4.0):
        est.step(8, 2, 2.2 + extra, regrouped=True)
        seen.append(est.snapshot().regroup_s)
        est.step(8, 2, 2.2)
    assert seen[0] < seen[1] < seen[2], seen
    assert 1.2 < seen[0] < 2.0 and 2.3 < seen[2] < 3.0, seen
