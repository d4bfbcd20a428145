import pytest
from units import convert


def test_kg_g():
    assert convert(1.5, "kg", "g") == pytest.approx(1500)


def test_pounds():
    assert convert(1, "lb", "kg") == pytest.approx(0.45359237)
    assert convert(1, "kg", "lb") == pytest.approx(2.2046226218)
