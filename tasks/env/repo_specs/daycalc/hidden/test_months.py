import pytest
from daycalc import days_in_month, is_leap


def test_leap_years():
    assert [y for y in (1996, 1999, 2000, 2100, 2400, 2024) if is_leap(y)] == [
        1996,
        2000,
        2400,
        2024,
    ]


def test_month_lengths():
    assert [days_in_month(2023, m) for m in range(1, 13)] == [
        31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31,
    ]  # fmt: skip


def test_february_in_leap_year():
    assert days_in_month(2024, 2) == 29 and days_in_month(1900, 2) == 28


def test_bad_month():
    for m in (0, 13):
        with pytest.raises(ValueError):
            days_in_month(2024, m)
