from roman import from_roman, to_roman


def test_to_roman_example():
    assert to_roman(1994) == "MCMXCIV"


def test_from_roman_example():
    assert from_roman("mmxxiv") == 2024
