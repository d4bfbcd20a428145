from graphs import components


def test_two_components():
    assert components([(1, 2), (4, 3), (2, 5)]) == [[1, 2, 5], [3, 4]]


def test_order_by_first_element():
    assert components([(9, 8), (1, 7)]) == [[1, 7], [8, 9]]


def test_empty():
    assert components([]) == []


def test_self_loop():
    assert components([(3, 3)]) == [[3]]
