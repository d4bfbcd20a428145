from intervals import intersect, merge


def test_merge_example():
    assert merge([(1, 3), (3, 5), (7, 8)]) == [(1, 5), (7, 8)]


def test_intersect_example():
    assert intersect([(0, 4)], [(2, 6)]) == [(2, 4)]
