import pytest
from graphs import CycleError, topo_sort


def test_dependencies_first():
    order = topo_sort({"app": ["lib", "util"], "lib": ["util"]})
    assert order == ["util", "lib", "app"]


def test_smallest_ready_first():
    assert topo_sort({3: [], 1: [], 2: []}) == [1, 2, 3]
    assert topo_sort({"d": ["a"], "c": ["a"], "b": []}) == ["a", "b", "c", "d"]


def test_cycle():
    with pytest.raises(CycleError):
        topo_sort({1: [2], 2: [3], 3: [1]})


def test_cycle_error_is_value_error():
    assert issubclass(CycleError, ValueError)
