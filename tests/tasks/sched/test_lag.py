"""The lag gate and admission on hand-built states (tasks/sched/lag.py)."""

import math

from tasks.sched.coordinator import CellView, SchedState, VersionCount
from tasks.sched.lag import admissible, gating, step_eta, step_ready


def state(versions=(), **kw) -> SchedState:
    base = dict(
        now=10_000.0,
        cells=(CellView(0, "rollout"), CellView(1, "train")),
        cap=4,
        water_level=sum(v.finished for v in versions),
        in_flight=sum(v.in_flight for v in versions),
        started=0,
        trained=0,
        finished_prefix=0,
        version=0,
        step_running=False,
        versions=tuple(versions),
    )
    base.update(kw)
    return SchedState(**base)


def test_gate_waits_for_every_rollout_that_could_not_be_trained_later():
    # weights v3, lag <= 1: a step from v3 is the last that may train base 2
    vs = [VersionCount(2, 1, 5, oldest_start=100.0), VersionCount(3, 4, 10)]
    s = state(vs, version=3)
    assert gating(s, 1) == (1, 100.0)
    assert not step_ready(s, batch=8, max_lag=1)  # base 2 still running
    s = state([VersionCount(2, 0, 5), VersionCount(3, 4, 10)], version=3)
    assert step_ready(s, batch=8, max_lag=1)
    assert not step_ready(s, batch=16, max_lag=1)  # 15 finished < batch
    # lag <= 2: base 2 could still be trained by the step from v4
    assert step_ready(state(vs, version=3), batch=8, max_lag=2)


def test_admission_by_hand():
    # newest weights v3, lag <= 1, batch 8: at most (3 + 1 + 1) * 8 = 40 started
    s = state(version=3, started=35)
    assert admissible(s, 8, 1) == 5
    assert admissible(state(version=3, started=41), 8, 1) == 0
    assert admissible(state(version=3, started=35), 8, 0) == 0  # lag 0: (3 + 1) * 8 = 32


def test_step_eta_is_the_later_of_the_gate_and_the_water():
    vs = [VersionCount(2, 1, 5, oldest_start=9_000.0), VersionCount(3, 0, 1)]
    s = state(vs, version=3, finish_rate=0.01)
    # gate: the base-2 rollout ends by 9,000 + 3,600 = 12,600 (now 10,000): 2,600 s
    # water: 6 finished, batch 8: 2 more at 0.01/s = 200 s
    assert step_eta(s, 8, 1, timeout_s=3_600.0, version=3) == 2_600.0
    assert step_eta(s, 40, 1, timeout_s=3_600.0, version=3) == 3_400.0  # 34 / 0.01
    # a step booked this tick took 4: water short by 6 -> 600 s, gate still 2,600 s
    assert step_eta(s, 8, 1, 3_600.0, version=3, taken=4) == 2_600.0
    open_gate = state([VersionCount(2, 0, 5), VersionCount(3, 3, 1)], version=3, finish_rate=0.01)
    assert step_eta(open_gate, 8, 1, 3_600.0, version=3, taken=4) == 600.0
    s0 = state([VersionCount(3, 0, 1)], version=3, finish_rate=0.0)
    assert step_eta(s0, 8, 1, 3_600.0, version=3) == math.inf
