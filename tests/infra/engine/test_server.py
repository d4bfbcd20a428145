"""The embedded engine over real HTTP (uvicorn on loopback) through `EngineClient`."""

import asyncio
import itertools
import time

import httpx
import pytest

from infra.engine.engine import Engine
from infra.engine.server import EngineServer
from infra.engine.tiny_model import make_tiny_model
from infra.engine_api.client import EngineClient, EngineError

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("srv")
    return make_tiny_model(base / "s0", seed=0), make_tiny_model(base / "s1", seed=1)


@pytest.fixture(scope="module")
def server(model_dirs):
    eng = Engine(model_dirs[0])
    srv = EngineServer(eng)
    url = srv.start()
    yield url, eng
    srv.stop()
    eng.close()


def run(coro):
    return asyncio.run(coro)


PROMPT = [(11 * i) % 900 + 7 for i in range(40)]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def test_generate_response_shape(server):
    url, _ = server

    async def go():
        async with EngineClient(url) as c:
            assert await c.health()
            info = await c.model_info()
            assert info["max_context_length"] >= 16384 and info["vocab_size"] == 1024
            assert info["eos_token_ids"]
            res = await c.generate(PROMPT, GREEDY, rid="req-shape-0001")
            return res

    res = run(go())
    meta = res["meta_info"]
    assert len(res["output_ids"]) == 10 and isinstance(res["text"], str)
    assert meta["id"] == "req-shape-0001"
    assert meta["finish_reason"] == {"type": "length", "length": 10}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (40, 10)
    assert meta["weight_version"] == "0"
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == res["output_ids"]
    assert all(lp <= 0 and txt is None for lp, _, txt in lps)


def test_stream_matches_non_stream(server):
    """Chunks are cumulative and end as the plain call. The server coalesces what the engine
    made since the last chunk, so on a loaded machine 10 tokens can all come in one chunk:
    ask for enough that the first chunk is sure to leave before the last token is made."""
    url, _ = server
    long = {**GREEDY, "max_new_tokens": 256}

    async def go():
        async with EngineClient(url) as c:
            full = await c.generate(PROMPT, long)
            chunks = [ch async for ch in c.generate_stream(PROMPT, long)]
            return full, chunks

    full, chunks = run(go())
    assert len(chunks) >= 2
    assert chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(ch["meta_info"]["finish_reason"] is None for ch in chunks[:-1])
    lens = [len(ch["output_ids"]) for ch in chunks]
    assert lens == sorted(lens)  # cumulative


def test_server_info_reports_kv_budget_use(server):
    url, eng = server
    eng.generate(PROMPT, GREEDY)
    info = httpx.get(f"{url}/get_server_info", timeout=10).json()
    assert info["kv_tokens_budget"] == eng.kv_budget
    assert 0 < info["kv_tokens_used"] <= info["kv_tokens_peak"] <= info["kv_tokens_budget"]


def test_stream_text_is_incremental_and_ends_as_the_full_decode(server):
    """Sampled outputs of a random model: plenty of byte tokens that split UTF-8 characters."""
    url, eng = server

    async def go():
        async with EngineClient(url) as c:
            runs = []
            for seed in range(4):
                sp = {"max_new_tokens": 48, "temperature": 1.0, "sampling_seed": seed}
                full = await c.generate(PROMPT, sp | {"ignore_eos": True})
                chunks = [ch async for ch in c.generate_stream(PROMPT, sp | {"ignore_eos": True})]
                runs.append((full, chunks))
            return runs

    for full, chunks in run(go()):
        assert chunks[-1]["output_ids"] == full["output_ids"]
        assert chunks[-1]["text"] == full["text"] == eng.tokenizer.decode(full["output_ids"])
        texts = [ch["text"] for ch in chunks]
        assert all(b.startswith(a) for a, b in itertools.pairwise(texts))


def test_raw_sse_framing(server):
    url, _ = server
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "stream": True}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=30) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_concurrent_clients_share_prefix_cache(server):
    url, eng = server
    eng.flush_cache()

    async def go():
        async with EngineClient(url) as c:
            first = await c.generate([*PROMPT, 1, 2], GREEDY)
            rest = await asyncio.gather(*[c.generate([*PROMPT, 3 + i], GREEDY) for i in range(8)])
            return first, rest

    first, rest = run(go())
    assert first["meta_info"]["cached_tokens"] == 0
    assert all(r["meta_info"]["cached_tokens"] >= len(PROMPT) for r in rest)


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b'{"input_ids": [1, 99999], "sampling_params": {}}',
        b'{"input_ids": [], "sampling_params": {}}',
        b'{"input_ids": [1, 2], "sampling_params": {"top_p": 0}}',
        b'{"input_ids": [1, 2], "sampling_params": "hot"}',
        b"[1, 2, 3]",
    ],
)
def test_bad_input_is_400_and_server_survives(server, body):
    url, _ = server
    resp = httpx.post(f"{url}/generate", content=body, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"]
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_context_over_limit_is_400(server):
    url, eng = server
    resp = httpx.post(f"{url}/generate", json={"input_ids": [5] * eng.max_context}, timeout=60)
    assert resp.status_code == 400 and "context" in resp.json()["error"]["message"]


def test_client_raises_engine_error_with_server_message(server):
    url, _ = server

    async def go():
        async with EngineClient(url) as c:
            with pytest.raises(EngineError) as info:
                await c.generate([1, 99999], {})
            return info.value

    err = run(go())
    assert err.status == 400 and "invalid token id 99999" in err.server_message


def test_client_retries_then_fails_on_dead_server(caplog):
    async def go():
        async with EngineClient("http://127.0.0.1:9", timeout=2) as c:
            assert not await c.health()
            with pytest.raises(EngineError, match="after 4 attempts"):
                await c.model_info()

    run(go())
    assert "attempt 3/4" in caplog.text


def test_control_endpoints_over_http(model_dirs):
    eng = Engine(model_dirs[0])
    srv = EngineServer(eng)
    url = srv.start()
    long = {"max_new_tokens": 400, "temperature": 1.0, "sampling_seed": 1, "ignore_eos": True}

    async def go():
        async with EngineClient(url) as c:
            task = asyncio.ensure_future(c.generate(PROMPT, long, rid="abc-0001"))
            while not eng.load()["running"]:
                await asyncio.sleep(0.01)
            await c.abort("abc")
            aborted = await task
            await c.pause("in_place")
            queued = asyncio.ensure_future(c.generate(PROMPT, GREEDY))
            await asyncio.sleep(0.2)
            assert not queued.done()
            await c.continue_()
            await queued
            res = await c.update_weights_from_disk(model_dirs[1], 5)
            version = await c.weight_version()
            after = await c.generate(PROMPT, GREEDY)
            with pytest.raises(EngineError) as bad:
                await c.update_weights_from_disk("/nonexistent/ckpt", 6)
            with pytest.raises(EngineError):
                await c.pause("sideways")
            await c.flush_cache()
            return aborted, res, version, after, bad.value

    try:
        aborted, res, version, after, bad = run(go())
        # the blocking form a cell uses (no event loop of its own)
        assert EngineClient.update_weights_blocking(url, model_dirs[0], 7)["success"] is True
        assert eng.weight_version == 7
        with pytest.raises(EngineError, match="nonexistent"):
            EngineClient.update_weights_blocking(url, "/nonexistent/ckpt", 8)
    finally:
        srv.stop()
        eng.close()
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(aborted["output_ids"]) < 400
    assert res["success"] is True and version == "5"
    assert after["meta_info"]["weight_version"] == "5"
    assert bad.status == 400 and "nonexistent" in bad.server_message


def test_stream_disconnect_aborts_the_request(server):
    url, eng = server
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 20000, "temperature": 0, "ignore_eos": True},
        "stream": True,
        "rid": "gone-0001",
    }
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data:"):
                break  # read one chunk, then hang up
    deadline = time.monotonic() + 30  # 20000 tokens would take minutes (wide: a loaded CI)
    while eng.load()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert eng.load()["running"] == 0


def test_client_speaks_to_sglang_shaped_answers():
    """An SGLang 0.5-like server: sparse model info, GET-only flush, 400 with `message`."""
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path))
        path = request.url.path
        if path == "/get_model_info":
            return httpx.Response(200, json={"model_path": "/m", "is_generation": True})
        if path == "/get_server_info":
            return httpx.Response(200, json={"context_length": 4096, "version": "0.5.3"})
        if path == "/flush_cache":
            return httpx.Response(405 if request.method == "POST" else 200, text="ok")
        if path == "/update_weights_from_disk":
            return httpx.Response(400, json={"success": False, "message": "no such path"})
        return httpx.Response(404, json={"detail": "Not Found"})

    async def go():
        async with EngineClient("http://sglang:30000", transport=httpx.MockTransport(handler)) as c:
            info = await c.model_info()
            await c.flush_cache()
            with pytest.raises(EngineError) as upd:
                await c.update_weights_from_disk("/nope", 3)
            with pytest.raises(EngineError) as kv:
                await c.export_kv([1, 2])
            return info, upd.value, kv.value

    info, upd, kv = run(go())
    assert info["max_context_length"] == 4096
    assert ("GET", "/flush_cache") in seen
    assert upd.status == 400 and upd.server_message == "no such path"
    assert kv.status == 404 and kv.server_message == "Not Found"


def test_plain_request_disconnect_aborts_the_request(server):
    url, eng = server
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 20000, "temperature": 0, "ignore_eos": True},
        "rid": "hangup-0001",
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/generate", json=body, timeout=1.0)
    deadline = time.monotonic() + 8  # the server notices within ~1 s; 20000 tokens take minutes
    while eng.load()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert eng.load()["running"] == 0
