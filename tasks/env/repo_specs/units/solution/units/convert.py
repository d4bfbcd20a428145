class UnitError(ValueError):
    pass


_LENGTH = {"mm": 0.001, "cm": 0.01, "m": 1.0, "km": 1000.0, "in": 0.0254, "ft": 0.3048}
_MASS = {"g": 0.001, "kg": 1.0, "lb": 0.45359237}
_TEMP = ("C", "F", "K")


def _to_kelvin(value, unit):
    if unit == "K":
        return value
    if unit == "C":
        return value + 273.15
    return (value - 32) * 5 / 9 + 273.15


def _from_kelvin(k, unit):
    if unit == "K":
        return k
    if unit == "C":
        return k - 273.15
    return (k - 273.15) * 9 / 5 + 32


def convert(value, src, dst):
    for table in (_LENGTH, _MASS):
        if src in table and dst in table:
            return float(value * table[src] / table[dst])
    if src in _TEMP and dst in _TEMP:
        k = _to_kelvin(value, src)
        if k < 0:
            raise UnitError("below absolute zero")
        return float(_from_kelvin(k, dst))
    raise UnitError(f"cannot convert {src!r} to {dst!r}")
