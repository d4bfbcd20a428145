import pytest
from intervals import merge


def test_unsorted_overlapping():
    assert merge([(5, 8), (1, 3), (2, 4)]) == [(1, 4), (5, 8)]


def test_touching_intervals_join():
    assert merge([(1, 2), (2, 3), (3, 3)]) == [(1, 3)]


def test_nested_and_lists():
    assert merge([[0, 10], [2, 3], [11, 12]]) == [(0, 10), (11, 12)]


def test_empty():
    assert merge([]) == []


def test_bad_interval():
    with pytest.raises(ValueError):
        merge([(3, 1)])
