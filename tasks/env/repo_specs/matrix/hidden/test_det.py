import pytest
from matrix import det, identity


def test_small():
    assert det([[5]]) == 5
    assert det([[1, 2], [3, 4]]) == -2


def test_three_by_three():
    assert det([[2, 0, 1], [1, 3, 2], [1, 1, 2]]) == 6
    assert det(identity(4)) == 1


def test_singular():
    assert det([[1, 2], [2, 4]]) == 0


def test_not_square():
    with pytest.raises(ValueError):
        det([[1, 2, 3], [4, 5, 6]])
