import pytest
from units import UnitError, convert


def test_unknown_unit():
    with pytest.raises(UnitError):
        convert(1, "m", "parsec")


def test_different_kinds():
    with pytest.raises(UnitError):
        convert(1, "m", "kg")
    with pytest.raises(UnitError):
        convert(1, "C", "g")


def test_below_absolute_zero():
    with pytest.raises(UnitError):
        convert(-300, "C", "K")
    with pytest.raises(UnitError):
        convert(-1, "K", "C")


def test_error_is_value_error():
    assert issubclass(UnitError, ValueError)
