from intervals import contains, total_length


def test_total_length_counts_overlap_once():
    assert total_length([(0, 4), (2, 6)]) == 6


def test_total_length_disjoint_and_empty():
    assert total_length([(0, 1), (5, 7.5)]) == 3.5
    assert total_length([]) == 0


def test_contains_ends_are_inside():
    ivs = [(1, 2), (5, 9)]
    assert contains(ivs, 1) and contains(ivs, 2) and contains(ivs, 7)


def test_contains_outside():
    ivs = [(1, 2), (5, 9)]
    assert not contains(ivs, 3) and not contains(ivs, 0) and not contains([], 1)
