from textstats import sentence_count, words


def test_words_example():
    assert words("Don't stop, don't!") == ["don't", "stop", "don't"]


def test_sentences_example():
    assert sentence_count("Hi! How are you?? Fine") == 3
