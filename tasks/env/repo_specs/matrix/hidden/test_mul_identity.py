import pytest
from matrix import identity, mul


def test_identity():
    assert identity(3) == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
    with pytest.raises(ValueError):
        identity(0)


def test_product():
    assert mul([[1, 2], [3, 4]], [[5, 6], [7, 8]]) == [[19, 22], [43, 50]]


def test_non_square_product():
    assert mul([[1, 2, 3]], [[1], [2], [3]]) == [[14]]
    assert mul([[1], [2]], [[3, 4]]) == [[3, 4], [6, 8]]


def test_identity_is_neutral_and_mismatch():
    a = [[2, 3], [4, 5]]
    assert mul(a, identity(2)) == a
    with pytest.raises(ValueError):
        mul([[1, 2]], [[1, 2]])
