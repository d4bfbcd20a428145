from matrix import add, det


def test_add_example():
    assert add([[1, 2]], [[3, 4]]) == [[4, 6]]


def test_det_example():
    assert det([[1, 2], [3, 4]]) == -2
