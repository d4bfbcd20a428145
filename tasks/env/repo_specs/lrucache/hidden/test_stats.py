from lrucache import LRUCache


def test_counts_start_at_zero():
    c = LRUCache(1)
    assert (c.hits, c.misses) == (0, 0)


def test_hits_and_misses():
    c = LRUCache(2)
    c.put("a", 1)
    c.get("a")
    c.get("a")
    c.get("b")
    assert (c.hits, c.misses) == (2, 1)


def test_put_and_contains_do_not_count():
    c = LRUCache(2)
    c.put("a", 1)
    assert "a" in c
    assert (c.hits, c.misses) == (0, 0)
