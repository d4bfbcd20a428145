from lrucache import LRUCache


def test_put_get_example():
    c = LRUCache(2)
    c.put("a", 1)
    assert c.get("a") == 1


def test_eviction_example():
    c = LRUCache(1)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") is None
