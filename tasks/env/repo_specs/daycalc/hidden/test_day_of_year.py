import pytest
from daycalc import day_of_year


def test_first_and_last():
    assert day_of_year(2023, 1, 1) == 1
    assert day_of_year(2023, 12, 31) == 365
    assert day_of_year(2024, 12, 31) == 366


def test_after_february():
    assert day_of_year(2023, 3, 1) == 60
    assert day_of_year(2024, 3, 1) == 61


def test_invalid_dates():
    for date in ((2023, 2, 29), (2023, 4, 31), (2023, 1, 0), (2023, 13, 1)):
        with pytest.raises(ValueError):
            day_of_year(*date)
