from roman import to_roman


def test_small_numbers():
    assert [to_roman(i) for i in range(1, 11)] == [
        "I", "II", "III", "IV", "V", "VI", "VII", "VIII", "IX", "X",
    ]  # fmt: skip


def test_subtractive_forms():
    assert to_roman(40) == "XL"
    assert to_roman(90) == "XC"
    assert to_roman(400) == "CD"
    assert to_roman(900) == "CM"


def test_larger_numbers():
    assert to_roman(1994) == "MCMXCIV"
    assert to_roman(2024) == "MMXXIV"
    assert to_roman(3999) == "MMMCMXCIX"


def test_round_numbers():
    assert to_roman(1000) == "M"
    assert to_roman(500) == "D"
    assert to_roman(50) == "L"
