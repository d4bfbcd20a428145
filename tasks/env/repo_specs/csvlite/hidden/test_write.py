from csvlite import format_line, parse_line, write


def test_format_quotes_only_when_needed():
    assert format_line(["a", "b c", "d,e", 'f"g', 3]) == 'a,b c,"d,e","f""g",3'


def test_write_missing_keys():
    assert write([{"a": 1}], ["a", "b"]) == "a,b\n1,\n"


def test_round_trip():
    fields = ["x", 'he said "no"', "1,2", ""]
    assert parse_line(format_line(fields)) == fields


def test_write_no_rows():
    assert write([], ["only"]) == "only\n"
