import pytest
from wrapping import fill


def test_fill_joins_lines():
    assert fill("the quick brown fox", 10) == "the quick\nbrown fox"


def test_fill_single_line_and_empty():
    assert fill("hello", 80) == "hello"
    assert fill("", 5) == ""


def test_fill_bad_width():
    with pytest.raises(ValueError):
        fill("x", -3)
