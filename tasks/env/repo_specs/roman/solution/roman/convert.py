_VALUES = [
    (1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
    (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"),
]  # fmt: skip


def to_roman(n):
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError("n must be an int")
    if not 1 <= n <= 3999:
        raise ValueError("n must be in 1..3999")
    out = []
    for value, letters in _VALUES:
        while n >= value:
            out.append(letters)
            n -= value
    return "".join(out)


_CANONICAL = {to_roman(i): i for i in range(1, 4000)}


def from_roman(s):
    if not isinstance(s, str):
        raise ValueError("not a Roman numeral")
    try:
        return _CANONICAL[s.upper()]
    except KeyError:
        raise ValueError(f"not a canonical Roman numeral: {s!r}") from None
