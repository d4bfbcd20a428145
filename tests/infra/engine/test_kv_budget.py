"""KV budget over everything the engine holds: radix cache + running requests' KV."""

import threading
import time

import pytest

from infra.engine.engine import Engine
from infra.engine.errors import EngineInputError
from infra.engine.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("kvb") / "m", seed=0)


def prompt(n, start):
    return [(start + 13 * i) % 900 + 20 for i in range(n)]


GREEDY = {"temperature": 0, "ignore_eos": True}


def sessions(eng, n=4, turns=2):
    """`n` concurrent multi-turn sessions; each turn extends the last input + output."""
    results = [[] for _ in range(n)]

    def session(i):
        ids = prompt(80, start=100 * i)
        for t in range(turns):
            res = eng.generate(ids, {**GREEDY, "max_new_tokens": 30})
            results[i].append(res)
            ids = ids + res["output_ids"] + prompt(10, start=7 * t + i)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    return results


def test_sessions_that_do_not_fit_queue_and_finish_identically(model_dir):
    budget = 400  # one turn needs up to 80 + 10 + 30 + 30 = 150 tokens: 4 cannot run at once
    ref_eng = Engine(model_dir)
    eng = Engine(model_dir, kv_cache_tokens=budget)
    seen = {"used": 0, "running": 0}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            load = eng.load()
            seen["used"] = max(seen["used"], load["kv_tokens_used"])
            seen["running"] = max(seen["running"], load["running"])
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        got = sessions(eng)
        ref = sessions(ref_eng)
    finally:
        stop.set()
        sampler.join()
        eng.close()
        ref_eng.close()
    for mine, theirs in zip(got, ref, strict=True):
        assert len(mine) == 2
        assert [r["output_ids"] for r in mine] == [r["output_ids"] for r in theirs]
        assert all(r["meta_info"]["finish_reason"]["type"] == "length" for r in mine)
    assert 0 < seen["used"] <= budget
    assert eng.load()["kv_tokens_peak"] <= budget
    assert seen["running"] < 4


def cached(eng, ids):
    return eng._run_command(lambda: eng.radix.prefix_len(ids))


def wait_running(eng, n):
    deadline = time.monotonic() + 10
    while eng.load()["running"] < n and time.monotonic() < deadline:
        time.sleep(0.002)
    assert eng.load()["running"] >= n


def test_lru_eviction_spares_the_prefix_a_running_request_uses(model_dir):
    eng = Engine(model_dir, kv_cache_tokens=9000)
    one = {**GREEDY, "max_new_tokens": 1}  # caches exactly the prompt
    P, B, A = prompt(100, 1), prompt(100, 2), prompt(100, 3)
    try:
        for p in (P, B, A):  # LRU order: P, B, A
            eng.generate(p, one)
        assert eng.load()["kv_tokens_used"] == 300
        # L reads (pins) P and runs long (until aborted): footprint 120 + 8000
        long = eng.submit([*P, *prompt(20, 4)], {**GREEDY, "max_new_tokens": 8000}, rid="L")
        wait_running(eng, 1)
        # D needs 650 more: 90 must go. P is the oldest but pinned, so B (next LRU) goes.
        d = eng.submit(prompt(150, 5), {**GREEDY, "max_new_tokens": 500}, rid="D")
        wait_running(eng, 2)
        assert cached(eng, B) == 0
        assert cached(eng, A) == 100 and cached(eng, P) == 100
        eng.abort("D")
        assert d.done.wait(10)
        # E cannot fit next to L's worst case even with every unpinned entry gone: it queues
        # and evicts nothing; L's prefix stays.
        e = eng.submit(prompt(900, 6), {**GREEDY, "max_new_tokens": 100}, rid="E")
        time.sleep(0.3)
        assert not e.done.is_set() and eng.load()["waiting"] == 1
        assert cached(eng, P) == 100 and cached(eng, A) == 100
        assert eng.load()["kv_tokens_used"] <= 9000
        eng.abort("L")
        assert long.done.wait(10) and e.done.wait(30)
        assert e.finish_reason["type"] == "length" and len(e.output_ids) == 100
        assert eng.load()["kv_tokens_peak"] <= 9000
    finally:
        eng.close()


def test_request_larger_than_the_budget_is_rejected(model_dir):
    eng = Engine(model_dir, kv_cache_tokens=100)
    try:
        with pytest.raises(EngineInputError, match="kv-cache-tokens"):
            eng.submit(prompt(60, 1), {"max_new_tokens": 50})
        assert eng.generate(prompt(60, 1), {"max_new_tokens": 40})["output_ids"]
    finally:
        eng.close()
