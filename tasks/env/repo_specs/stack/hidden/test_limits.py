import pytest
from stack import Stack, StackFull


def test_full_stack():
    s = Stack(limit=2)
    s.push(1)
    s.push(2)
    with pytest.raises(StackFull):
        s.push(3)
    assert s.items() == [1, 2]


def test_room_after_pop():
    s = Stack(limit=1)
    s.push(1)
    s.pop()
    s.push(2)
    assert s.items() == [2]


def test_bad_limit():
    with pytest.raises(ValueError):
        Stack(limit=0)


def test_no_limit():
    s = Stack()
    for i in range(1000):
        s.push(i)
    assert len(s) == 1000
