import pytest
from units import convert


def test_celsius_fahrenheit():
    assert convert(0, "C", "F") == pytest.approx(32)
    assert convert(-40, "F", "C") == pytest.approx(-40)


def test_kelvin():
    assert convert(0, "K", "C") == pytest.approx(-273.15)
    assert convert(32, "F", "K") == pytest.approx(273.15)


def test_same_unit():
    assert convert(21.5, "C", "C") == pytest.approx(21.5)
