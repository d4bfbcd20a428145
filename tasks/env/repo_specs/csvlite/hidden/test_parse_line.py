import pytest
from csvlite import parse_line


def test_plain_fields():
    assert parse_line("a,b,c") == ["a", "b", "c"]


def test_spaces_kept_and_empty_fields():
    assert parse_line(" a,,b ") == [" a", "", "b "]
    assert parse_line("") == [""]
    assert parse_line(",") == ["", ""]


def test_quotes():
    assert parse_line('"x, y","say ""hi"""') == ["x, y", 'say "hi"']


def test_unterminated_quote():
    with pytest.raises(ValueError):
        parse_line('a,"b')
