import pytest
from textstats import top_words


def test_most_frequent_first():
    assert top_words("a b a c a b", 2) == [("a", 3), ("b", 2)]


def test_ties_alphabetical():
    assert top_words("pear apple fig apple fig pear", 3) == [("apple", 2), ("fig", 2), ("pear", 2)]


def test_case_is_ignored():
    assert top_words("Go go GO stop", 1) == [("go", 3)]


def test_fewer_words_than_n():
    assert top_words("x y", 5) == [("x", 1), ("y", 1)]
    assert top_words("x y", 0) == []


def test_negative_n():
    with pytest.raises(ValueError):
        top_words("x", -1)
