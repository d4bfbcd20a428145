from wrapping import justify, wrap


def test_wrap_example():
    assert wrap("the quick brown fox", 10) == ["the quick", "brown fox"]


def test_justify_example():
    assert justify("a bb c", 5) == ["a  bb", "c"]
