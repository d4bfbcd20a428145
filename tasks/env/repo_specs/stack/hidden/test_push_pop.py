import pytest
from stack import Stack, StackEmpty


def test_lifo_order():
    s = Stack()
    for x in (1, 2, 3):
        s.push(x)
    assert [s.pop(), s.pop(), s.pop()] == [3, 2, 1]


def test_pop_empty():
    with pytest.raises(StackEmpty):
        Stack().pop()


def test_peek_keeps_item():
    s = Stack()
    s.push("x")
    assert s.peek() == "x" and len(s) == 1


def test_peek_empty():
    with pytest.raises(StackEmpty):
        Stack().peek()
