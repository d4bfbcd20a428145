_DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]


def is_leap(year):
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def days_in_month(year, month):
    if not 1 <= month <= 12:
        raise ValueError(f"month {month} not in 1..12")
    return 29 if month == 2 and is_leap(year) else _DAYS[month - 1]


def _check(year, month, day):
    if not 1 <= year <= 9999:
        raise ValueError("year out of range")
    if not 1 <= day <= days_in_month(year, month):
        raise ValueError(f"invalid date {year}-{month}-{day}")


def day_of_year(year, month, day):
    _check(year, month, day)
    return sum(days_in_month(year, m) for m in range(1, month)) + day


def _ordinal(year, month, day):
    """Days since 0001-01-01 (which is day 1)."""
    y = year - 1
    return y * 365 + y // 4 - y // 100 + y // 400 + day_of_year(year, month, day)


def weekday(year, month, day):
    return (_ordinal(year, month, day) - 1) % 7  # 0001-01-01 was a Monday


def add_days(year, month, day, n):
    _check(year, month, day)
    target = _ordinal(year, month, day) + n
    y = max(1, target // 366)
    while _ordinal(y + 1, 1, 1) <= target:
        y += 1
    rest = target - _ordinal(y, 1, 1)
    m = 1
    while rest >= days_in_month(y, m):
        rest -= days_in_month(y, m)
        m += 1
    return (y, m, rest + 1)
