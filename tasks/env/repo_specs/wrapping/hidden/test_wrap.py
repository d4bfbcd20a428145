import pytest
from wrapping import wrap


def test_greedy_lines():
    assert wrap("one two three four five", 9) == ["one two", "three", "four five"]


def test_exact_fit():
    assert wrap("ab cd", 5) == ["ab cd"]


def test_long_word_alone():
    assert wrap("a extraordinary b", 5) == ["a", "extraordinary", "b"]


def test_spacing_ignored_and_blank():
    assert wrap("  x \n\n y\tz ", 3) == ["x y", "z"]
    assert wrap("   ", 4) == []


def test_bad_width():
    with pytest.raises(ValueError):
        wrap("x", 0)
