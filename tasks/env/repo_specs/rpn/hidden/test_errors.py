import pytest
from rpn import RPNError, evaluate


def test_not_enough_values():
    with pytest.raises(RPNError):
        evaluate("1 +")


def test_too_many_values():
    with pytest.raises(RPNError):
        evaluate("1 2")


def test_empty():
    with pytest.raises(RPNError):
        evaluate("")


def test_division_by_zero():
    with pytest.raises(RPNError):
        evaluate("1 0 /")
