from intervals import intersect


def test_overlap():
    assert intersect([(0, 4)], [(2, 6)]) == [(2, 4)]


def test_several_pieces():
    assert intersect([(0, 2), (5, 10)], [(1, 6), (8, 12)]) == [(1, 2), (5, 6), (8, 10)]


def test_single_point_kept():
    assert intersect([(0, 3)], [(3, 5)]) == [(3, 3)]


def test_disjoint_and_empty():
    assert intersect([(0, 1)], [(2, 3)]) == []
    assert intersect([], [(0, 1)]) == []
