from textstats import word_count, words


def test_lower_case_and_order():
    assert words("The Cat sat") == ["the", "cat", "sat"]


def test_punctuation_splits_words():
    assert words("red,green;blue.") == ["red", "green", "blue"]


def test_digits_and_apostrophes():
    assert words("It's 42 o'clock") == ["it's", "42", "o'clock"]


def test_word_count():
    assert word_count("one two  three\nfour") == 4
    assert word_count("") == 0
    assert word_count("... !!") == 0
