"""``cluster.advertise_host`` and the run's token (issue 19: cells on other hosts).

- Every endpoint a run opens binds the configured host; loopback (the default) is the
  single-host run, unchanged: engines there take calls without a token.
- Beyond loopback, a cell's engine binds its worker's address and refuses every call but
  ``/health`` without the run's token (generation, weight loads, pauses, KV export/import);
  `EngineClient` sends the token over each of its transports; the gateway's admin calls
  were already token-only.
- A cell's host that cannot see the run's store is named before anything runs; a cell on a
  host without the run's model directory starts from checkpoint v0 in the store.
- Gloo's peers meet a member at its cell's address (``GLOO_SOCKET_IFNAME``).
"""

from __future__ import annotations

import asyncio
import os
import socket

import httpx
import psutil
import pytest

from flows.config import ConfigError, load_config
from flows.preflight import check_host
from infra.cells.config import ClusterConfig, is_loopback
from infra.engine.engine import Engine
from infra.engine.server import EngineServer
from infra.engine.tiny_model import make_tiny_model
from infra.engine_api.client import EngineClient, EngineError
from tasks.train import dp

TOKEN = "run-token-123"
CONTROL = [  # (method, path, body): every engine call that is not /health
    ("POST", "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}),
    ("GET", "/get_model_info", None),
    ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent"}),
    ("POST", "/pause_generation", {}),
    ("POST", "/flush_cache", None),
    ("POST", "/gyre/kv/export", {"input_ids": [1, 2, 3]}),
    ("POST", "/gyre/kv/import", None),
]


def beyond_loopback() -> str:
    """An IPv4 address of this host that is not loopback (the test skips without one)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            v4 = a.family == socket.AF_INET and not is_loopback(a.address)
            if v4 and check_host(a.address) is None:
                return a.address
    pytest.skip("this host has no IPv4 address beyond loopback to bind")


@pytest.fixture(scope="module")
def model_dir():
    return make_tiny_model(seed=0)


def test_advertise_host_defaults_to_loopback_and_refuses_wildcards():
    assert ClusterConfig().advertise_host == "127.0.0.1"
    for bad in ("0.0.0.0", "::", "*", "a b"):
        with pytest.raises(ValueError, match="advertise"):
            ClusterConfig(advertise_host=bad)
    assert ClusterConfig(advertise_host=" 10.0.0.5 ").advertise_host == "10.0.0.5"


def test_preflight_refuses_an_address_this_host_does_not_have():
    with pytest.raises(ConfigError, match=r"cluster.advertise_host='203.0.113.77'.*cannot listen"):
        from flows.preflight import checked

        checked(
            lambda: load_config(preset="tiny", overrides=["cluster.advertise_host=203.0.113.77"])
        )


def _status(url: str, method: str, path: str, body, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if body is None:
        return httpx.request(method, url + path, headers=headers, timeout=30).status_code
    return httpx.request(method, url + path, json=body, headers=headers, timeout=30).status_code


def test_an_engine_with_a_key_refuses_every_call_without_it(model_dir):
    with EngineServer(Engine(model_dir, cell_id="k"), api_key=TOKEN) as srv:
        assert _status(srv.url, "GET", "/health", None, None) == 200
        for method, path, body in CONTROL:
            assert _status(srv.url, method, path, body, None) == 401, path
            assert _status(srv.url, method, path, body, "wrong") == 401, path
        assert _status(srv.url, "GET", "/get_model_info", None, TOKEN) == 200

        async def over(transport: str, token: str | None) -> dict:
            async with EngineClient(srv.url, transport=transport, token=token) as c:
                return await c.model_info()

        for transport in ("http1", "aiohttp", httpx.AsyncHTTPTransport()):
            assert asyncio.run(over(transport, TOKEN))["vocab_size"] > 0
        with pytest.raises(EngineError) as err:
            asyncio.run(over("http1", None))
        assert err.value.status == 401


def test_a_cells_engine_binds_its_workers_address_and_needs_the_token_beyond_loopback(
    model_dir, tmp_path
):
    from infra.cells.cluster import start_cells
    from infra.cells.engines import load_weights, start_engine
    from infra.cells.reach import StoreUnreachable, check_store
    from storage.checkpoints import publish_checkpoint
    from storage.store import Store

    ip = beyond_loopback()
    store = Store(str(tmp_path / "store"))
    with start_cells(1, threads_per_cell=1, harness_slots=1, host=ip, token=TOKEN) as cells:
        (addr,) = cells.roles
        assert addr.startswith(f"tcp://{ip}:")
        if cells.dashboard_link:  # the LocalCluster's dashboard binds the host too
            assert f"//{ip}:" in cells.dashboard_link
        # the run's checkpoint v0 is not in the store yet: the cell and its host are named
        with pytest.raises(StoreUnreachable, match=rf"cell cell-{ip}:\d+ on host {ip}: "):
            check_store(cells, store, "r1")
        # a store the cells' host cannot reach at all (nothing listens there)
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{free.getsockname()[1]}"
        s3 = Store("s3://bucket/x", {"endpoint_url": dead, "key": "k", "secret": "s"}, retry_s=1)
        with pytest.raises(StoreUnreachable, match=rf"on host {ip}: cannot reach the store"):
            check_store(cells, s3, "r1", retry_s=1)
        publish_checkpoint(store, "r1", model_dir, 0)
        check_store(cells, store, "r1")
        # the run's model directory is not on the cell's host: it starts from v0 in the store
        url = cells.run_on(
            addr,
            start_engine,
            str(tmp_path / "only-on-the-runs-host"),
            cell_id="c0",
            store=store,
            run_id="r1",
        )
        assert url.startswith(f"http://{ip}:")
        for method, path, body in CONTROL:
            assert _status(url, method, path, body, None) == 401, path
        assert _status(url, "GET", "/get_model_info", None, TOKEN) == 200
        res = cells.run_on(addr, load_weights, store, "r1", 0)  # the cell sends the token
        assert res["success"], res


def test_on_loopback_the_default_is_unchanged(model_dir):
    from infra.cells.cluster import start_cells
    from infra.cells.engines import start_engine

    with start_cells(1, threads_per_cell=1, harness_slots=1, token=TOKEN) as cells:
        (addr,) = cells.roles
        assert addr.startswith("tcp://127.0.0.1:")
        url = cells.run_on(addr, start_engine, model_dir, cell_id="c0")
        assert url.startswith("http://127.0.0.1:")
        assert _status(url, "GET", "/get_model_info", None, None) == 200


def test_the_gateways_admin_calls_need_the_token_beyond_loopback(model_dir, tmp_path):
    from infra.gateway.gateway import Gateway
    from storage.store import Store

    ip = beyond_loopback()
    gw = Gateway(
        Store(str(tmp_path / "s")),
        run_id="r",
        tokenizer_dir=model_dir,
        admin_token=TOKEN,
        host=ip,
        spool_dir=str(tmp_path / "spool"),
    )
    with gw:
        assert gw.url.startswith(f"http://{ip}:")
        assert _status(gw.url, "POST", "/gyre/sessions", {}, None) == 401
        assert _status(gw.url, "GET", "/gyre/stats", None, None) == 401
        assert _status(gw.url, "POST", "/gyre/sessions", {}, TOKEN) == 200


def test_gloo_meets_a_member_at_its_cells_address(monkeypatch):
    monkeypatch.delenv(dp.GLOO_IFNAME, raising=False)
    monkeypatch.delenv("_GYRE_GLOO_FOR", raising=False)
    assert dp.use_interface_of("127.0.0.1") is None  # one host: nothing changes
    assert dp.GLOO_IFNAME not in os.environ
    ip = beyond_loopback()
    ifname = dp.use_interface_of(ip)
    assert ifname == dp.interface_of(ip) and os.environ[dp.GLOO_IFNAME] == ifname
    monkeypatch.setenv(dp.GLOO_IFNAME, "users-own")
    monkeypatch.delenv("_GYRE_GLOO_FOR")
    assert dp.use_interface_of(ip) == "users-own"  # a user's setting wins
