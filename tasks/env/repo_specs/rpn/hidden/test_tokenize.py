import pytest
from rpn import RPNError, tokenize


def test_ints_and_operators():
    assert tokenize("1 2 + 3 * 4 - 5 / 6 ^") == [1, 2, "+", 3, "*", 4, "-", 5, "/", 6, "^"]


def test_types():
    toks = tokenize("2 2.5 -1e3")
    assert toks == [2, 2.5, -1000.0]
    assert isinstance(toks[0], int) and isinstance(toks[1], float)


def test_whitespace():
    assert tokenize("  7\t8\n+ ") == [7, 8, "+"]
    assert tokenize("") == []


def test_bad_token():
    with pytest.raises(RPNError):
        tokenize("1 x +")


def test_error_is_value_error():
    assert issubclass(RPNError, ValueError)
