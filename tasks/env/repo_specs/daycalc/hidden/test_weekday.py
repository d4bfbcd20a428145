import pytest
from daycalc import weekday


def test_known_days():
    assert weekday(2024, 1, 1) == 0
    assert weekday(2000, 1, 1) == 5
    assert weekday(1969, 7, 20) == 6


def test_consecutive_days():
    assert [weekday(2024, 2, d) for d in range(26, 30)] == [0, 1, 2, 3]


def test_invalid_date():
    with pytest.raises(ValueError):
        weekday(2023, 2, 30)
