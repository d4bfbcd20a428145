from wrapping import justify


def test_lines_have_width_except_last():
    lines = justify("the quick brown fox jumps over the lazy dog", 15)
    assert lines == ["the quick brown", "fox  jumps over", "the lazy dog"]


def test_extra_spaces_go_left_first():
    assert justify("a b c d e", 8) == ["a  b c d", "e"]


def test_single_word_and_long_word_untouched():
    assert justify("abc defghijk xy", 6) == ["abc", "defghijk", "xy"]


def test_last_line_not_stretched():
    assert justify("aa bb cc", 5) == ["aa bb", "cc"]
