import pytest
from units import convert


def test_length_example():
    assert convert(1, "km", "m") == pytest.approx(1000)


def test_temperature_example():
    assert convert(100, "C", "F") == pytest.approx(212)
