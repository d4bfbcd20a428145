from daycalc.dates import add_days, day_of_year, days_in_month, is_leap, weekday

__all__ = ["add_days", "day_of_year", "days_in_month", "is_leap", "weekday"]
