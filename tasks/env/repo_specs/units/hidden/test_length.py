import pytest
from units import convert


def test_metric():
    assert convert(2.5, "m", "cm") == pytest.approx(250)
    assert convert(1234, "mm", "km") == pytest.approx(0.001234)


def test_imperial():
    assert convert(1, "ft", "in") == pytest.approx(12)
    assert convert(10, "in", "cm") == pytest.approx(25.4)


def test_returns_float():
    assert isinstance(convert(1, "m", "m"), float)
