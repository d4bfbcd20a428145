from graphs import shortest_path, topo_sort


def test_path_example():
    assert shortest_path([(1, 2), (2, 3)], 1, 3) == [1, 2, 3]


def test_topo_example():
    assert topo_sort({"b": ["a"]}) == ["a", "b"]
