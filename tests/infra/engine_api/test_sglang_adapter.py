"""SGLang adapter: command line, version checks, process launch and drain.

The HTTP parts run against the embedded engine server on CPU (same API). The real-SGLang test
needs a CUDA GPU and an installed sglang, and is skipped without them.
"""

import asyncio
import importlib.util
import shutil
import socket
import sys

import pytest

from infra.engine.engine import Engine
from infra.engine.server import EngineServer
from infra.engine.tiny_model import make_tiny_model
from infra.engine_api.client import EngineClient, EngineError
from infra.engine_api.sglang import (
    Pending,
    SGLangLaunchError,
    SGLangServer,
    UnsupportedSGLangVersion,
    check_version,
    drain,
    probe_version,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("sgl") / "m", seed=0)


def test_command_line_flags(tmp_path):
    srv = SGLangServer(
        "/models/qwen", port=30001, tp=2, extra_args=["--mem-fraction-static", "0.8"]
    )
    assert srv.command() == [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/qwen",
        "--host",
        "127.0.0.1",
        "--port",
        "30001",
        "--tp-size",
        "2",
        "--mem-fraction-static",
        "0.8",
    ]
    assert "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR" not in srv.env() or srv.env()[
        "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
    ] == __import__("os").environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
    hc = SGLangServer("/m", port=1, hicache_storage=tmp_path / "kv")
    cmd = hc.command()
    assert cmd[cmd.index("--hicache-storage-backend") + 1] == "file"
    assert "--enable-hierarchical-cache" in cmd
    assert hc.env()["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] == str(tmp_path / "kv")
    mc = SGLangServer("/m", port=1, hicache_storage="mooncake").command()
    assert mc[mc.index("--hicache-storage-backend") + 1] == "mooncake"
    with pytest.raises(ValueError, match="tp"):
        SGLangServer("/m", port=1, tp=0)


@pytest.mark.parametrize("version", ["0.5.0", "0.5.4.post2", "v0.6.1", "gyre-embedded-0.1"])
def test_supported_versions(version):
    assert check_version(version) == version


@pytest.mark.parametrize("version", ["0.4.10", "0.3.0", "1.0.0", "weird"])
def test_unsupported_versions_raise_clearly(version):
    with pytest.raises(UnsupportedSGLangVersion, match="not supported"):
        check_version(version)


@pytest.mark.integration
def test_launch_probe_and_stop_a_server_process(model_dir, tmp_path):
    """The launcher's process path, using the embedded server's SGLang-compatible CLI."""
    srv = SGLangServer(
        model_dir,
        port=free_port(),
        module="infra.engine.server",
        extra_args=["--mem-fraction-static", "0.5"],  # an SGLang flag it must tolerate
        log_path=tmp_path / "server.log",
    )
    with srv:
        assert srv.version.startswith("gyre-")
        assert probe_version(srv.url) == srv.version

        async def go():
            async with EngineClient(srv.url) as c:
                return await c.generate([5, 6, 7], {"max_new_tokens": 3, "temperature": 0})

        assert len(asyncio.run(go())["output_ids"]) == 3
    proc_gone = srv._proc is None
    assert proc_gone


@pytest.mark.integration
def test_a_server_launched_with_an_api_key_takes_calls_with_it_only(model_dir, tmp_path):
    """``--api-key`` (SGLang's flag; the embedded server's too): the launcher's own probes
    and `EngineClient(token=)` carry it, a call without it is refused."""
    import httpx

    srv = SGLangServer(model_dir, port=free_port(), module="infra.engine.server", api_key="k1")
    assert srv.command()[-2:] == ["--api-key", "k1"]
    with srv:
        assert srv.version.startswith("gyre-")  # probed with the key
        assert httpx.get(srv.url + "/get_model_info", timeout=10).status_code == 401

        async def go(token):
            async with EngineClient(srv.url, token=token) as c:
                return await c.model_info()

        assert asyncio.run(go("k1"))["vocab_size"] > 0
        with pytest.raises(EngineError):
            asyncio.run(go(None))


@pytest.mark.integration
def test_launch_failure_names_the_log(tmp_path):
    srv = SGLangServer(
        tmp_path / "no-such-model",
        port=free_port(),
        module="infra.no_such_server_module",  # exits at once, like a broken install
        log_path=tmp_path / "server.log",
    )
    with pytest.raises(SGLangLaunchError, match="exited with code"):
        srv.start(timeout=120)
    assert (tmp_path / "server.log").stat().st_size > 0


@pytest.fixture
def two_servers(model_dir):
    engines = [Engine(model_dir), Engine(model_dir)]
    servers = [EngineServer(e) for e in engines]
    urls = [s.start() for s in servers]
    yield urls, engines
    for s in servers:
        s.stop()
    for e in engines:
        e.close()


PROMPT = [(17 * i) % 900 + 11 for i in range(64)]


@pytest.mark.integration
@pytest.mark.parametrize("move_kv", [True, False])
def test_drain_moves_in_flight_requests(two_servers, move_kv):
    (url_a, url_b), (eng_a, _) = two_servers
    greedy = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}

    async def go():
        async with EngineClient(url_a) as a, EngineClient(url_b) as b:
            reference = await b.generate(PROMPT, greedy)
            await b.flush_cache()
            pending = []
            for i in range(3):
                rid = f"sess-{i:04d}-req-0001"
                task = asyncio.ensure_future(a.generate(PROMPT, greedy, rid=rid))
                pending.append(Pending(PROMPT, greedy, rid, task))
            short = asyncio.ensure_future(
                a.generate(PROMPT[:8], {"max_new_tokens": 2, "temperature": 0})
            )
            while sum(len(r.output_ids) for r in list(eng_a._running)) < 30:
                await asyncio.sleep(0.01)
            await short
            pending.append(Pending(PROMPT[:8], {"max_new_tokens": 2}, "done-0001", short))
            # sent after the source is paused: it queues there and must be moved too
            await a.pause("in_place")
            late = asyncio.ensure_future(a.generate(PROMPT, greedy, rid="late-0001"))
            while not eng_a.load()["waiting"]:
                await asyncio.sleep(0.01)
            pending.append(Pending(PROMPT, greedy, "late-0001", late))
            merged = await drain(a, b, pending, move_kv=move_kv)
            return reference, merged

    reference, merged = asyncio.run(go())
    for m in merged[:3] + merged[4:]:
        meta = m["meta_info"]
        assert 0 <= meta["drained_tokens"] < 200
        # greedy continues exactly where the source stopped
        assert m["output_ids"] == reference["output_ids"]
        assert meta["completion_tokens"] == 200 and meta["finish_reason"]["type"] == "length"
        assert [t for _, t, _ in meta["output_token_logprobs"]] == m["output_ids"]
        if move_kv and meta["drained_tokens"]:
            assert meta["cached_tokens"] >= len(PROMPT) + meta["drained_tokens"] - 1
    assert all(m["meta_info"]["drained_tokens"] > 0 for m in merged[:3])
    assert merged[4]["meta_info"]["drained_tokens"] == 0  # never started on the source
    assert merged[3]["meta_info"]["finish_reason"]["type"] == "length"  # finished before
    assert eng_a.load()["paused"] == "abort"


@pytest.mark.gpu
def test_real_sglang_server_end_to_end(model_dir, tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None:
        pytest.skip("needs a CUDA GPU and sglang installed")
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no nvidia-smi")
    srv = SGLangServer(model_dir, port=free_port(), log_path=tmp_path / "sglang.log")
    with srv:
        check_version(srv.version)

        async def go():
            async with EngineClient(srv.url) as c:
                info = await c.model_info()
                res = await c.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0})
                return info, res

        info, res = asyncio.run(go())
        assert info["model_path"]
        assert len(res["output_ids"]) == 8
        assert len(res["meta_info"]["output_token_logprobs"]) == 8
