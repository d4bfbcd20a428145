"""A paced session (bench/modes.py, a workload file's rollout) holds its slot for its drawn
duration with a model call at the start of every interval: its environment steps wait for
the interval's end, however long the call before took."""

from __future__ import annotations

import time

import pytest

from tasks.rollout import SlowEnv, Stopped, paced_calls


class _Env:
    def __init__(self):
        self.at: list[float] = []

    def submit(self, *a, **k):
        self.at.append(time.time())
        return 1.0


def test_steps_end_at_the_interval_deadlines_and_the_last_at_the_duration():
    assert paced_calls(2.5, 1.0) == 3 and paced_calls(3.0, 1.0) == 3 and paced_calls(0.2, 1.0) == 1
    t0 = time.time()
    env = _Env()
    until = [t0 + min(0.5, (k + 1) * 0.2) for k in range(paced_calls(0.5, 0.2))]
    s = SlowEnv(env, 0.0, 0.0, 0, until=until)
    time.sleep(0.25)  # a slow model call: the first interval is already over
    for _ in range(4):  # one more step than planned (a retry) does not wait again
        s.submit("t", "answer", "rid")
    assert env.at[0] - t0 < 0.35  # no extra wait after a slow call
    assert env.at[1] >= t0 + 0.4 and env.at[2] >= t0 + 0.5
    assert env.at[3] - env.at[2] < 0.1


def test_a_stopped_run_ends_a_paced_session_within_a_second():
    t = time.time()
    s = SlowEnv(_Env(), 0.0, 0.0, 0, stopped=lambda: time.time() > t + 0.3, until=[t + 30])
    with pytest.raises(Stopped):  # the run ends while the session waits for its deadline
        s.submit("t", "a", "r")
    assert time.time() - t < 1.8
