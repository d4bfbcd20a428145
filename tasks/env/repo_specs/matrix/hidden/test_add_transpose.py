import pytest
from matrix import add, transpose


def test_add():
    assert add([[1, 2], [3, 4]], [[10, 20], [30, 40]]) == [[11, 22], [33, 44]]


def test_add_shape_mismatch():
    with pytest.raises(ValueError):
        add([[1, 2]], [[1], [2]])


def test_transpose():
    assert transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]
    assert transpose([[7]]) == [[7]]


def test_inputs_unchanged():
    a = [[1, 2], [3, 4]]
    add(a, a)
    transpose(a)
    assert a == [[1, 2], [3, 4]]
