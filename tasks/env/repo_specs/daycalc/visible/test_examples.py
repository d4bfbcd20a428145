from daycalc import is_leap, weekday


def test_leap_example():
    assert is_leap(2000) and not is_leap(1900)


def test_weekday_example():
    assert weekday(2024, 1, 1) == 0
