"""Engine control: abort, pause modes, hot weight reload, KV export/import."""

import time

import pytest

from infra.engine.engine import Engine
from infra.engine.kv_transfer import KVFormatError
from infra.engine.tiny_model import ARCHS, make_tiny_model

every_arch = pytest.mark.parametrize("dirs", ARCHS, indirect=True)


@pytest.fixture(scope="module")
def dirs(request, tmp_path_factory):
    """Two tiny models (seeds 0, 1) of one architecture family (Qwen3 unless parametrized)."""
    arch = getattr(request, "param", "qwen3")
    base = tmp_path_factory.mktemp(f"ctl-{arch}")
    return (
        make_tiny_model(base / "s0", seed=0, arch=arch),
        make_tiny_model(base / "s1", seed=1, arch=arch),
    )


@pytest.fixture
def engine(dirs):
    eng = Engine(dirs[0])
    yield eng
    eng.close()


def wait_until(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.005)
    raise AssertionError("condition not reached")


PROMPT = [(13 * i) % 950 + 9 for i in range(48)]
LONG = {"max_new_tokens": 300, "temperature": 1.0, "sampling_seed": 42, "ignore_eos": True}


def test_abort_by_rid_prefix(engine):
    a1 = engine.submit(PROMPT, LONG, rid="sess-A-0001")
    a2 = engine.submit(PROMPT[:30], LONG, rid="sess-A-0002")
    b = engine.submit(PROMPT[:20], LONG | {"max_new_tokens": 40}, rid="sess-B-0001")
    wait_until(lambda: len(a1.output_ids) >= 3 and len(a2.output_ids) >= 3)
    assert engine.abort("sess-A") == 2
    for r in (a1, a2, b):
        assert r.done.wait(30)
    for r in (a1, a2):
        assert r.finish_reason["type"] == "abort"
        assert 3 <= len(r.output_ids) < 300
        assert len(r.output_logprobs) == len(r.output_ids)
    assert b.finish_reason["type"] == "length" and len(b.output_ids) == 40
    assert engine.abort("nothing-matches") == 0


def test_abort_while_paused_finishes_at_once(engine):
    r = engine.submit(PROMPT, LONG, rid="paused-0001")
    wait_until(lambda: len(r.output_ids) >= 2)
    engine.pause_generation("in_place")
    assert engine.abort("paused-") == 1
    assert r.done.wait(5) and r.finish_reason["type"] == "abort"
    assert engine.load()["running"] == 0
    engine.continue_generation()


def test_pause_abort_then_continue(engine):
    r = engine.submit(PROMPT, LONG)
    wait_until(lambda: len(r.output_ids) >= 2)
    engine.pause_generation("abort")
    assert r.done.is_set() and r.finish_reason["type"] == "abort"
    queued = engine.submit(PROMPT, {"max_new_tokens": 5, "temperature": 0})
    time.sleep(0.2)
    assert not queued.output_ids  # paused: nothing runs
    engine.continue_generation()
    assert queued.done.wait(30) and len(queued.output_ids) == 5


@every_arch
@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_keeps_request_and_resumes_identically(engine, mode):
    reference = engine.generate(PROMPT, LONG | {"max_new_tokens": 120})
    engine.flush_cache()
    r = engine.submit(PROMPT, LONG | {"max_new_tokens": 120})
    wait_until(lambda: len(r.output_ids) >= 10)
    engine.pause_generation(mode)
    n = len(r.output_ids)
    load = engine.load()
    assert (load["running"], load["waiting"]) == ((0, 1) if mode == "retract" else (1, 0))
    time.sleep(0.2)
    assert len(r.output_ids) == n and not r.done.is_set()
    engine.continue_generation()
    assert r.done.wait(30)
    assert r.output_ids == reference["output_ids"]
    ref_lps = [x[0] for x in reference["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(r.output_logprobs, ref_lps, strict=True)) <= 1e-4


@every_arch
def test_update_weights_in_flight_and_versions(engine, dirs):
    fresh = Engine(dirs[1], weight_version=7)
    try:
        expected = fresh.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0})["output_ids"]
    finally:
        fresh.close()
    engine.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0})  # warm the cache
    r = engine.submit(PROMPT, LONG | {"max_new_tokens": 200})
    wait_until(lambda: len(r.output_ids) >= 5)
    res = engine.update_weights_from_disk(dirs[1], 7)
    assert res["success"], res
    assert engine.weight_version == 7
    assert r.done.wait(30) and r.finish_reason["type"] == "length"
    versions = r.token_versions
    assert versions[0] == 0 and versions[-1] == 7 and versions == sorted(versions)
    assert engine.response(r)["meta_info"]["weight_version"] == "0"  # first token's version
    after = engine.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0})
    assert after["meta_info"]["cached_tokens"] == 0  # flushed: no stale KV reused
    assert after["meta_info"]["weight_version"] == "7"
    assert after["output_ids"] == expected


def test_update_weights_abort_all_and_bad_path(engine, dirs, tmp_path):
    r = engine.submit(PROMPT, LONG)
    wait_until(lambda: len(r.output_ids) >= 2)
    res = engine.update_weights_from_disk(dirs[1], 3, abort_all_requests=True)
    assert res["success"] and r.finish_reason["type"] == "abort"
    bad = engine.update_weights_from_disk(str(tmp_path / "missing"), 4)
    assert bad["success"] is False and "missing" in bad["message"]
    assert engine.weight_version == 3


@every_arch
def test_kv_export_import_continues_identically(dirs):
    src, dst, cold = Engine(dirs[0]), Engine(dirs[0]), Engine(dirs[0])
    try:
        first = src.generate(PROMPT * 4, {"max_new_tokens": 16, "temperature": 0})
        turn2 = PROMPT * 4 + first["output_ids"] + [21, 22, 23]
        seeded = {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 9}
        blob = src.export_kv(turn2)
        n = dst.import_kv(blob)
        assert n == len(PROMPT) * 4 + 15  # prompt + output minus the last (uncomputed) token
        on_src = src.generate(turn2, seeded)
        on_dst = dst.generate(turn2, seeded)
        on_cold = cold.generate(turn2, seeded)
        assert on_dst["meta_info"]["cached_tokens"] == n
        assert on_cold["meta_info"]["cached_tokens"] == 0
        assert on_dst["output_ids"] == on_src["output_ids"] == on_cold["output_ids"]
        # nothing cached: an empty export imports zero tokens
        assert dst.import_kv(cold.export_kv([1000, 1001])) == 0
    finally:
        for e in (src, dst, cold):
            e.close()


def test_kv_import_rejects_garbage_and_foreign_shapes(engine):
    from infra.engine import kv_transfer

    with pytest.raises(KVFormatError):
        engine.import_kv(b"not a blob at all")
    meta = engine._kv_meta() | {"head_dim": 8}
    import torch

    foreign = kv_transfer.dumps([1, 2], torch.zeros(2, 2, 2, 2, 8), meta)
    with pytest.raises(KVFormatError, match="head_dim"):
        engine.import_kv(foreign)


def test_internal_error_aborts_in_flight_and_engine_keeps_serving(engine, monkeypatch):
    r = engine.submit(PROMPT, LONG)
    wait_until(lambda: len(r.output_ids) >= 2)
    real = engine._forward
    calls = {"n": 0}

    def broken(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "_forward", broken)
    assert r.done.wait(30)
    assert r.finish_reason["type"] == "abort"
    assert "simulated kernel failure" in r.finish_reason["message"]
    after = engine.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0})
    assert len(after["output_ids"]) == 4
    assert engine.load()["running"] == 0


def test_closed_engine_refuses_work(dirs):
    eng = Engine(dirs[0])
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit(PROMPT, {})
    with pytest.raises(RuntimeError, match="closed"):
        eng.flush_cache()


def test_another_architecture_of_the_same_shape_is_refused(dirs, tmp_path):
    """The tiny Qwen3 and Llama have the same KV and weight shapes (2 layers, 2 KV heads,
    head_dim 16, same vocab) but compute different things: Qwen3 KV imported into a Llama
    engine, or Qwen3 weights hot-loaded under a running Llama's KV, would be silently wrong."""
    llama = make_tiny_model(tmp_path / "llama", seed=0, arch="llama")
    src, dst = Engine(dirs[0]), Engine(llama)
    try:
        assert src._kv_meta()["num_kv_heads"] == dst._kv_meta()["num_kv_heads"]
        assert src._kv_meta()["head_dim"] == dst._kv_meta()["head_dim"]
        src.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0})
        blob = src.export_kv(PROMPT)
        with pytest.raises(KVFormatError, match="model_type"):
            dst.import_kv(blob)
        assert dst.load()["radix_tokens"] == 0
        res = dst.update_weights_from_disk(dirs[0], 5)
        assert res["success"] is False and "qwen3" in res["message"], res
        assert dst.weight_version == 0 and type(dst.model).__name__ == "LlamaForCausalLM"
        # the same family still moves both ways
        again = Engine(llama)
        try:
            dst.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0})
            assert again.import_kv(dst.export_kv(PROMPT)) == len(PROMPT)
            assert again.update_weights_from_disk(llama, 1)["success"]
        finally:
            again.close()
    finally:
        src.close()
        dst.close()
