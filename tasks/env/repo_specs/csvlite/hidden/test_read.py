import pytest
from csvlite import read


def test_rows_as_dicts():
    assert read("name,age\nann,31\nbob,4\n") == [
        {"name": "ann", "age": "31"},
        {"name": "bob", "age": "4"},
    ]


def test_empty_lines_skipped():
    assert read("a\n\n1\n\n") == [{"a": "1"}]


def test_header_only_and_empty():
    assert read("a,b\n") == []
    assert read("") == []


def test_wrong_field_count():
    with pytest.raises(ValueError):
        read("a,b\n1,2,3\n")
