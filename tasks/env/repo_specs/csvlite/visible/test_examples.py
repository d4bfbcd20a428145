from csvlite import parse_line, write


def test_parse_example():
    assert parse_line('a,"b,c",""""') == ["a", "b,c", '"']


def test_write_example():
    assert write([{"x": 1, "y": 2}], ["x", "y"]) == "x,y\n1,2\n"
