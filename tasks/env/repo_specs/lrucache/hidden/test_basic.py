import pytest
from lrucache import LRUCache


def test_get_default():
    c = LRUCache(2)
    assert c.get("x") is None
    assert c.get("x", 7) == 7


def test_put_replaces_value():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("a", 2)
    assert c.get("a") == 2 and len(c) == 1


def test_contains_and_len():
    c = LRUCache(3)
    c.put(1, "one")
    c.put(2, "two")
    assert 1 in c and 3 not in c and len(c) == 2


def test_bad_capacity():
    for cap in (0, -1, 2.5, "3"):
        with pytest.raises(ValueError):
            LRUCache(cap)
