import pytest
from roman import from_roman, to_roman


def test_out_of_range():
    for n in (0, -1, 4000):
        with pytest.raises(ValueError):
            to_roman(n)


def test_not_an_int():
    for n in (1.5, "12", True):
        with pytest.raises(TypeError):
            to_roman(n)


def test_non_canonical_numerals():
    for s in ("IIII", "IC", "VV", "MMMM"):
        with pytest.raises(ValueError):
            from_roman(s)


def test_not_numerals():
    for s in ("", "ABC", "X I"):
        with pytest.raises(ValueError):
            from_roman(s)
