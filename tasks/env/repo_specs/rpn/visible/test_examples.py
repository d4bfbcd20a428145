from rpn import evaluate, tokenize


def test_tokenize_example():
    assert tokenize("3 4 +") == [3, 4, "+"]


def test_evaluate_example():
    assert evaluate("3 4 + 2 *") == 14
