from graphs import shortest_path


def test_shorter_of_two_routes():
    edges = [(1, 2), (2, 3), (3, 4), (1, 5), (5, 4)]
    assert shortest_path(edges, 1, 4) == [1, 5, 4]


def test_tie_broken_by_sorted_neighbours():
    edges = [("a", "c"), ("a", "b"), ("b", "d"), ("c", "d")]
    assert shortest_path(edges, "a", "d") == ["a", "b", "d"]


def test_undirected():
    assert shortest_path([(1, 2), (3, 2)], 3, 1) == [3, 2, 1]


def test_no_path_and_same_node():
    assert shortest_path([(1, 2), (3, 4)], 1, 4) is None
    assert shortest_path([(1, 2)], 2, 2) == [2]
