"""No flapping: role switches stay bounded while the water level is noisy.

A closed loop around the elastic policy alone: moves land at once, and every
tick the time to the next step (the level the policy reads, ``step_eta``) is
drawn from a noisy signal. Admission always has rollouts waiting for a slot
and every non-core cell is empty, so each signal could move a cell: only the
dead band between the marks and the dwell time hold them.
"""

import random

from tasks.sched.coordinator import CellView, Move, SchedState, VersionCount
from tasks.sched.modes import Elastic
from tasks.sched.waterlevel import Marks

TICK = 60.0
TICKS = 1_440  # one day
MARKS = Marks(low=100.0, high=1_000.0)


def policy(**kw) -> Elastic:
    args = dict(
        batch=8,
        core=1,
        train_s_per_sample=10.0,
        dp_sync_s=1.0,
        timeout_s=10_000.0,
        marks=MARKS,
        max_lag=1,
        min_dwell_s=300.0,
    )
    args.update(kw)
    return Elastic(**args)


def switches_per_cell_day(pol: Elastic, eta) -> float:
    """Run the loop for a day; ``eta(rng)`` draws the time to the next step."""
    rng = random.Random(0)
    roles = ["rollout"] * 2 + ["train"] * 4
    since = [-1e9] * len(roles)
    moves = 0
    for k in range(TICKS):
        now = 100_000.0 + k * TICK
        cells = [
            CellView(i, r, sessions=4 if i == 0 else 0, weight_version=5, since=since[i])
            for i, r in enumerate(roles)
        ]
        # one base-4 rollout gates the next step: it ends at oldest_start + timeout
        oldest = now + eta(rng) - pol.timeout_s
        s = SchedState(
            now=now,
            cells=tuple(cells),
            cap=4,
            water_level=8,
            in_flight=1,
            started=48,  # (5 + 1 + 1) * 8 - 48 = 8 may start: demand for slots
            trained=40,
            finished_prefix=47,
            version=5,
            step_running=False,
            finish_rate=1.0,
            versions=(VersionCount(4, 1, 8, oldest_start=oldest),),
            published_at=now,
        )
        for d in pol.recommendations(s):
            if isinstance(d, Move):
                roles[d.cell] = d.to
                since[d.cell] = now
                moves += 1
    return moves / (len(roles) - 1)  # per non-core cell, per day


def test_noise_inside_the_dead_band_moves_nothing():
    mid, half = (MARKS.low + MARKS.high) / 2, 0.45 * (MARKS.high - MARKS.low)
    assert switches_per_cell_day(policy(), lambda r: mid + r.uniform(-half, half)) == 0


def test_noise_around_one_mark_does_not_flap():
    """Wobbling +-50 s around the low mark: at most the first recruit happens."""
    n = switches_per_cell_day(policy(), lambda r: MARKS.low + r.uniform(-50, 50))
    assert n <= 1


def test_noise_across_both_marks_is_held_by_the_dwell_time():
    """Every tick a fresh draw below or above both marks: at most one switch per dwell."""
    pol = policy(min_dwell_s=1_800.0)
    n = switches_per_cell_day(pol, lambda r: r.choice((0.0, 5_000.0)))
    assert 0 < n <= 86_400 / pol.min_dwell_s + 1
