"""`flows.rl_run._made_meanwhile`: the gateway is made while the cells start; if the cells
fail before the run takes it, it is closed (its write-ahead log and files), and a gateway
the run took is left to the run (which stops it itself)."""

from __future__ import annotations

import threading

import pytest

from flows.rl_run import _made_meanwhile


class _Thing:
    def __init__(self, gate: threading.Event, made_in: list) -> None:
        gate.wait(10)
        made_in.append(threading.current_thread().name)
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_made_in_another_thread_and_left_to_the_taker():
    gate, made_in = threading.Event(), []
    with _made_meanwhile(_Thing, gate, made_in) as take:
        gate.set()
        thing = take()
    assert made_in and made_in[0] != threading.current_thread().name
    assert thing.closed == 0


def test_closed_once_made_when_the_block_fails_before_taking_it():
    gate, made_in, seen = threading.Event(), [], []

    class Seen(_Thing):
        def close(self) -> None:
            seen.append(self)
            super().close()

    with pytest.raises(RuntimeError, match="cells failed"), _made_meanwhile(Seen, gate, made_in):
        raise RuntimeError("cells failed")  # before the thing is made
    gate.set()  # it is made after the failure, then closed
    for _ in range(200):
        if seen:
            break
        threading.Event().wait(0.05)
    assert len(seen) == 1 and seen[0].closed == 1


def test_a_taken_thing_is_not_closed_by_a_later_failure():
    gate, made_in = threading.Event(), []
    gate.set()
    with pytest.raises(RuntimeError), _made_meanwhile(_Thing, gate, made_in) as take:
        thing = take()
        raise RuntimeError("the loop failed")  # the run's own finally stops its gateway
    assert thing.closed == 0
