"""Radix prefix cache: matching, edge splits, LRU eviction under the token budget."""

import torch

from infra.engine.radix_cache import RadixCache


def kv_for(ids):
    """Fake KV (L=1, 2, H=1, n, D=1) whose values encode the token ids, to check slicing."""
    t = torch.tensor(ids, dtype=torch.float32)
    return torch.stack([t, -t]).reshape(1, 2, 1, len(ids), 1)


def values(kv):
    return kv[0, 0, 0, :, 0].long().tolist()


def test_match_insert_and_split():
    rc = RadixCache(max_tokens=1000)
    assert rc.match([1, 2, 3]) == (0, None)
    assert rc.insert([1, 2, 3, 4, 5], kv_for([1, 2, 3, 4, 5])) == 5
    n, kv = rc.match([1, 2, 3, 9])
    assert n == 3 and values(kv) == [1, 2, 3]
    assert torch.equal(kv[0, 1], -kv[0, 0])
    # a branch splits the edge; only the new suffix is stored
    assert rc.insert([1, 2, 7, 8], kv_for([1, 2, 7, 8])) == 2
    assert rc.total_tokens == 7 and rc.num_nodes() == 3
    n, kv = rc.match([1, 2, 7, 8, 9])
    assert n == 4 and values(kv) == [1, 2, 7, 8]
    n, kv = rc.match([1, 2, 3, 4, 5, 6])
    assert n == 5 and values(kv) == [1, 2, 3, 4, 5]
    assert rc.insert([1, 2, 3], kv_for([1, 2, 3])) == 0  # already there
    rc.flush()
    assert rc.total_tokens == 0 and rc.match([1, 2]) == (0, None)


def test_lru_eviction_keeps_budget_and_recent_entries():
    rc = RadixCache(max_tokens=12)
    rc.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))  # A
    rc.insert([5, 6, 7, 8], kv_for([5, 6, 7, 8]))  # B
    rc.insert([9, 10, 11, 12], kv_for([9, 10, 11, 12]))  # C
    rc.match([1, 2, 3, 4])  # A is now the most recently used
    rc.insert([13, 14, 15, 16], kv_for([13, 14, 15, 16]))  # D: over budget -> evict B
    assert rc.total_tokens == 12
    assert rc.match([5, 6, 7, 8])[0] == 0
    assert rc.match([1, 2, 3, 4])[0] == 4
    assert rc.match([9, 10, 11, 12])[0] == 4
    assert rc.match([13, 14, 15, 16])[0] == 4


def test_eviction_removes_leaves_before_shared_prefix():
    rc = RadixCache(max_tokens=100)
    rc.insert([1, 2, 3, 4, 5, 6], kv_for([1, 2, 3, 4, 5, 6]))
    rc.insert([1, 2, 3, 7, 8, 9], kv_for([1, 2, 3, 7, 8, 9]))
    rc.match([1, 2, 3, 7, 8, 9])  # the 7-8-9 branch is recent
    assert rc.evict(max_tokens=6) == 3
    assert rc.match([1, 2, 3, 4, 5, 6])[0] == 3  # only the shared prefix is left of it
    assert rc.match([1, 2, 3, 7, 8, 9])[0] == 6
    assert rc.evict(max_tokens=0) == 6 and rc.total_tokens == 0


def test_engine_cache_respects_token_budget(tmp_path):
    from infra.engine.engine import Engine
    from infra.engine.tiny_model import make_tiny_model

    eng = Engine(make_tiny_model(tmp_path / "m"), kv_cache_tokens=200)
    try:
        for i in range(6):
            prompt = [(i * 31 + j) % 900 + 10 for j in range(60)]
            eng.generate(prompt, {"max_new_tokens": 5, "temperature": 0})
            assert eng.load()["radix_tokens"] <= 200
        last = [(5 * 31 + j) % 900 + 10 for j in range(60)]
        again = eng.generate(last, {"max_new_tokens": 5, "temperature": 0})
        assert again["meta_info"]["cached_tokens"] == 59  # most recent survived
        first = [j % 900 + 10 for j in range(60)]
        cold = eng.generate(first, {"max_new_tokens": 5, "temperature": 0})
        assert cold["meta_info"]["cached_tokens"] == 0  # oldest was evicted
    finally:
        eng.close()


def test_locked_path_survives_eviction_and_splits():
    rc = RadixCache(max_tokens=100)
    rc.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))  # oldest
    rc.insert([5, 6, 7, 8], kv_for([5, 6, 7, 8]))
    handle = rc.lock([1, 2, 3])  # a request reads [1, 2, 3]: the whole edge is pinned
    assert rc.pinned_tokens == 4
    rc.insert([1, 2, 9], kv_for([1, 2, 9]))  # splits the pinned edge: both halves stay pinned
    assert rc.pinned_tokens == 4 and rc.total_tokens == 9
    assert rc.evict(max_tokens=0) == 5  # [5..8] and the unpinned [9] go; the pinned path stays
    assert rc.match([1, 2, 3, 4])[0] == 4 and rc.total_tokens == 4
    rc.unlock(handle)
    assert rc.pinned_tokens == 0 and rc.evict(max_tokens=0) == 4
    rc.insert([1, 2], kv_for([1, 2]))
    stale = rc.lock([1, 2])
    rc.flush()
    rc.unlock(stale)  # a handle from before the flush is ignored
    assert rc.pinned_tokens == 0 and rc.total_tokens == 0
