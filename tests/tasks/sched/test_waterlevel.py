"""Waterlevel marks, hysteresis and the DP step-time model, by hand."""

import pytest

from tasks.sched.waterlevel import (
    Marks,
    best_members,
    dp_step_seconds,
    members_to_keep_up,
    waterlevel_signal,
)


def test_signal_dead_band():
    m = Marks(low=10, high=30)
    assert waterlevel_signal(30, m) == 1
    assert waterlevel_signal(29.9, m) == 0
    assert waterlevel_signal(10, m) == 0
    assert waterlevel_signal(9, m) == -1


def test_no_flapping_around_a_mark():
    """A level wobbling +-1 around either mark never gives opposite signals."""
    m = Marks(low=10, high=30)
    for mark in (m.low, m.high):
        sigs = {waterlevel_signal(mark + d, m) for d in (-1, 1, -1, 1, 0)}
        assert not ({1, -1} <= sigs)


def test_marks_validated():
    with pytest.raises(ValueError, match="low < high"):
        Marks(low=5, high=5)


def test_dp_step_time_by_hand():
    # 100 samples x 2 s over 4 members + 3 s sync each = 50 + 12
    assert dp_step_seconds(100, 4, 2.0, 3.0) == pytest.approx(62.0)
    with pytest.raises(ValueError):
        dp_step_seconds(1, 0, 1.0, 1.0)


def test_best_members_is_the_argmin():
    for b, t, s, lim in [(100, 2.0, 3.0, 50), (8000, 60.0, 2.0, 1000), (32, 60.0, 2.0, 3)]:
        m = best_members(b, t, s, lim)
        brute = min(range(1, lim + 1), key=lambda k: (dp_step_seconds(b, k, t, s), k))
        assert m == brute


def test_members_to_keep_up():
    # 100 samples arrive in 100 s (rate 1/s); with headroom 1: need 200/m + m <= 100 -> m = 3
    assert members_to_keep_up(100, 2.0, 1.0, rate=1.0, limit=50, headroom=1.0) == 3
    assert members_to_keep_up(100, 2.0, 1.0, rate=0.0, limit=50) == 1
    # impossible to keep up: fall back to the fastest size
    assert members_to_keep_up(100, 2.0, 1.0, rate=100.0, limit=50) == best_members(
        100, 2.0, 1.0, 50
    )


def test_due_signal_dead_band_in_seconds():
    """Time to the next step: soon -> staff training, far -> lend, between -> hold."""
    from tasks.sched.waterlevel import due_signal

    m = Marks(low=100.0, high=1_000.0)
    assert due_signal(0.0, m) == 1 and due_signal(100.0, m) == 1
    assert due_signal(100.1, m) == 0 and due_signal(999.9, m) == 0
    assert due_signal(1_000.0, m) == -1 and due_signal(float("inf"), m) == -1
