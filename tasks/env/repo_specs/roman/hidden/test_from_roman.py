from roman import from_roman, to_roman


def test_basic_values():
    assert from_roman("III") == 3
    assert from_roman("XLII") == 42
    assert from_roman("MCMXCIV") == 1994


def test_lower_case_is_accepted():
    assert from_roman("mmxxiv") == 2024
    assert from_roman("cdxliv") == 444


def test_round_trip():
    for n in (1, 4, 9, 14, 40, 90, 400, 900, 1666, 2999, 3888):
        assert from_roman(to_roman(n)) == n


def test_largest():
    assert from_roman("MMMCMXCIX") == 3999
