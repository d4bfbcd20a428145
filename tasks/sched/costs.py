"""The policy's cost model, calibrated from the run itself.

A policy sizes training and sets its marks from what steps, role changes and
weight loads cost. Config gives a first guess; the run then measures them, and
live they differ a lot from any guess (steps of 8.8-21.7 s where the config said
1.3-2.2 s; a DP regroup ~9 s where the model had none). :class:`CostEstimator`
learns them from the events the coordinator already receives, the same way
live and in the simulator:

- **step time** ``= a * samples / members + b * members + r * regrouped``
  (``a``: seconds per sample on one member, ``b``: DP cost per member, ``r``:
  extra when the members differ from the previous step's). ``a`` and ``b``: a
  least-squares fit (of the time less ``r`` where a step regrouped)
  over the steps so far, each weighted ``forget ** age`` so the fit follows a
  cost that drifts (training that grows with rollout length), and pulled
  towards the config guess by a weak prior (about ``prior_weight`` of one
  step), so a direction the run never explores (one member count all run)
  keeps the guess's shape while the measured steps set its scale. Such a fit
  lags a drifting cost by about ``forget / (1 - forget)`` steps, so the
  per-step trend of its prediction (smoothed, at most +-``max_drift``) carries
  the estimate forward to the next step: steady growth is followed without
  that lag. ``r``: the smoothed residual of regrouped steps less that of the
  others (at least 0), kept out of the fit: when the per-sample cost swings
  from step to step (which rollouts a step trains), a third coefficient fitted
  jointly soaks up the swing. Off by default (``learn_regroup``): in the
  simulator, whose regroups are free, the first step of each pair (new
  members) trains the oldest, longest rollouts, so "regrouped" steps cost more
  for another reason and ``r`` came out at 100-650 s; the policy does not use
  ``r`` yet.
- **drain** (a rollout cell told to train until it trains: its sessions'
  next call boundaries plus the switch), **to rollout** (a train cell told to
  roll out until it does: switch plus weight load) and **weight load** (a
  rollout cell's refresh): exponentially smoothed means, unknown (``None``)
  until seen once.

:meth:`CostEstimator.snapshot` is the frozen :class:`Costs` a policy reads
from ``SchedState.costs``. Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Costs:
    """What the policy assumes, as measured so far (seconds).

    ``train_s_per_sample``, ``dp_sync_s``, ``regroup_s``: the step model's
    coefficients; ``steps``: steps measured (0: these are the config guess).
    ``drain_s``, ``to_rollout_s``, ``weight_load_s``: smoothed measurements,
    ``None`` until the first one. ``sizes``: the member counts measured steps had
    (the first few, sorted): with one only, the split of a step's time into per-sample
    and per-member cost is the guess's, not the run's (a policy may try a second size).
    """

    train_s_per_sample: float
    dp_sync_s: float
    regroup_s: float = 0.0
    steps: int = 0
    drain_s: float | None = None
    to_rollout_s: float | None = None
    weight_load_s: float | None = None
    sizes: tuple[int, ...] = ()

    def step_seconds(self, samples: int, members: int, regroup: bool = False) -> float:
        """Predicted wall time of a step on ``samples`` over ``members`` cells."""
        if members < 1:
            raise ValueError(f"a training step needs at least one member, got {members}")
        return (
            samples * self.train_s_per_sample / members
            + self.dp_sync_s * members
            + (self.regroup_s if regroup else 0.0)
        )


def _solve(a: list[list[float]], y: list[float]) -> list[float]:
    """Solve the small symmetric positive definite system ``a x = y`` (Gauss, pivoting)."""
    n = len(y)
    m = [row[:] + [y[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if abs(m[c][c]) < 1e-300:
            return [0.0] * n
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


@dataclass
class CostEstimator:
    """Running estimates of step, regroup, drain and load costs (see the module text).

    Seeded with the config's guesses; :meth:`step`, :meth:`drain`,
    :meth:`to_rollout` and :meth:`weight_load` feed measurements;
    ``learn=False`` keeps the guesses (what a run without calibration does).
    """

    train_s_per_sample: float
    dp_sync_s: float
    regroup_s: float = 0.0
    forget: float = 0.85
    prior_weight: float = 0.05
    smooth: float = 0.3
    max_drift: float = 0.1
    learn: bool = True
    learn_regroup: bool = False
    _sxx: list[list[float]] = field(default_factory=lambda: [[0.0] * 2 for _ in range(2)])
    _sxy: list[float] = field(default_factory=lambda: [0.0] * 2)
    _scale: list[float] | None = None  # typical feature sizes (the prior's metric)
    _theta: tuple[float, float] | None = None
    _regroup: float = 0.0
    _res: list[float | None] = field(default_factory=lambda: [None, None])  # not / regrouped
    _drift: float = 0.0  # smoothed log change per step of the fit's prediction
    _steps: int = 0
    _sizes: set[int] = field(default_factory=set)
    _drain: float | None = None
    _to_rollout: float | None = None
    _load: float | None = None

    def __post_init__(self) -> None:
        if self.train_s_per_sample <= 0 or self.dp_sync_s < 0 or self.regroup_s < 0:
            raise ValueError(
                f"cost guesses must be train_s_per_sample > 0, dp_sync_s >= 0, regroup_s >= 0; "
                f"got {self.train_s_per_sample}, {self.dp_sync_s}, {self.regroup_s}"
            )
        if not 0 < self.forget <= 1:
            raise ValueError(f"forget must be in (0, 1], got {self.forget}")
        self._theta = (self.train_s_per_sample, self.dp_sync_s)
        self._regroup = self.regroup_s

    # -- measurements
    def step(self, samples: int, members: int, seconds: float, regrouped: bool = False) -> None:
        """One optimizer step on ``samples`` over ``members`` took ``seconds``."""
        if not self.learn or members < 1 or samples < 1 or not seconds >= 0:
            return
        x = [samples / members, float(members)]
        if self._scale is None:
            self._scale = x[:]
        y = seconds - (self._regroup if regrouped else 0.0)
        g = self.forget
        for i in range(2):
            self._sxy[i] = g * self._sxy[i] + x[i] * y
            for j in range(2):
                self._sxx[i][j] = g * self._sxx[i][j] + x[i] * x[j]
        self._steps += 1
        if len(self._sizes) < 4:
            self._sizes.add(members)
        before = self._theta
        self._theta = self._fit()
        a, b = self._theta
        k = 1 if regrouped else 0
        self._res[k] = self._ewma(self._res[k], seconds - a * x[0] - b * x[1])
        if self.learn_regroup and self._res[0] is not None and self._res[1] is not None:
            self._regroup = max(0.0, self._res[1] - self._res[0])
        if self._steps > 1 and before is not None:
            at = lambda th: th[0] * self._scale[0] + th[1] * self._scale[1]  # noqa: E731
            if at(before) > 0 and at(self._theta) > 0:
                d = math.log(at(self._theta) / at(before))
                d = max(-self.max_drift, min(self.max_drift, d))
                self._drift += self.smooth * (d - self._drift)

    def _fit(self) -> tuple[float, float]:
        assert self._scale is not None
        prior = (self.train_s_per_sample, self.dp_sync_s)
        # the prior's weight per coefficient: a step that disagrees with the guess moves
        # the per-sample and per-member costs in proportion (the guess's shape, hence
        # its best member count, stays until other member counts are measured)
        x0, m0 = self._scale
        y0 = x0 * prior[0] + m0 * prior[1]
        w = [
            self.prior_weight * x0 * y0 / max(prior[0], 0.01 * y0 / x0),
            self.prior_weight * m0 * y0 / max(prior[1], 0.01 * y0 / m0),
        ]
        free = [0, 1]
        theta = [0.0, 0.0]
        while free:  # least squares with the prior; a negative coefficient is fixed at 0
            a = [[self._sxx[i][j] + (w[i] if i == j else 0.0) for j in free] for i in free]
            y = [self._sxy[i] + w[i] * prior[i] for i in free]
            sol = _solve(a, y)
            neg = [free[k] for k, v in enumerate(sol) if v < 0]
            if not neg:
                for k, i in enumerate(free):
                    theta[i] = sol[k]
                break
            free = [i for i in free if i not in neg]
        # a sample always costs something: never below a thousandth of the guess
        theta[0] = max(theta[0], 1e-3 * self.train_s_per_sample)
        return theta[0], theta[1]

    def _ewma(self, old: float | None, x: float) -> float:
        return x if old is None else old + self.smooth * (x - old)

    def drain(self, seconds: float) -> None:
        """A rollout cell told to train got there in ``seconds``."""
        if self.learn and seconds >= 0:
            self._drain = self._ewma(self._drain, seconds)

    def to_rollout(self, seconds: float) -> None:
        """A train cell told to roll out got there (switch and weights) in ``seconds``."""
        if self.learn and seconds >= 0:
            self._to_rollout = self._ewma(self._to_rollout, seconds)

    def weight_load(self, seconds: float) -> None:
        """A rollout cell loaded new weights in ``seconds``."""
        if self.learn and seconds >= 0:
            self._load = self._ewma(self._load, seconds)

    def snapshot(self) -> Costs:
        assert self._theta is not None
        a, b = self._theta
        # the fit is about forget / (1 - forget) steps old; the next step one more
        ahead = math.exp(self._drift * (1.0 / (1.0 - self.forget) if self.forget < 1 else 1.0))
        return Costs(
            a * ahead,
            b * ahead,
            self._regroup,
            self._steps,
            self._drain,
            self._to_rollout,
            self._load,
            tuple(sorted(self._sizes)),
        )
