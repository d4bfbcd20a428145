from rpn import evaluate


def test_addition_and_product():
    assert evaluate("3 4 + 2 *") == 14


def test_order_of_operands():
    assert evaluate("10 3 -") == 7
    assert evaluate("7 2 /") == 3.5


def test_power():
    assert evaluate("2 3 ^") == 8
    assert evaluate("2 0.5 ^") == 2**0.5


def test_single_value():
    assert evaluate("42") == 42


def test_longer_expression():
    assert evaluate("5 1 2 + 4 * + 3 -") == 14
