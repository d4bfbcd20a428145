from daycalc import add_days


def test_within_month():
    assert add_days(2024, 1, 1, 10) == (2024, 1, 11)


def test_across_months_and_years():
    assert add_days(2023, 12, 31, 1) == (2024, 1, 1)
    assert add_days(2024, 2, 28, 1) == (2024, 2, 29)
    assert add_days(2023, 2, 28, 1) == (2023, 3, 1)


def test_backwards():
    assert add_days(2024, 3, 1, -1) == (2024, 2, 29)
    assert add_days(2024, 1, 1, -1) == (2023, 12, 31)


def test_long_span():
    assert add_days(2000, 1, 1, 366) == (2001, 1, 1)
    assert add_days(2024, 1, 1, 0) == (2024, 1, 1)
