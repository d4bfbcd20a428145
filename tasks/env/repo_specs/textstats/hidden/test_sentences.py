from textstats import sentence_count


def test_simple_sentences():
    assert sentence_count("One. Two. Three.") == 3


def test_runs_of_marks_count_once():
    assert sentence_count("What?! Really... Yes!!!") == 3


def test_trailing_text_is_a_sentence():
    assert sentence_count("Hi! How are you?? Fine") == 3
    assert sentence_count("no end mark") == 1


def test_empty_text():
    assert sentence_count("") == 0
    assert sentence_count("   ") == 0
