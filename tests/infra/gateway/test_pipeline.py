"""The call pipeline's two rules, end to end: every path settles, and only recorded calls count.

A withdrawal of a cell waits for the calls of its sessions that finished generating but are not
recorded yet (their context is the KV to move). A path that forgot to settle would stall it
(~30 s, then move stale KV); here a withdrawal right after each kind of call — chat,
completions, native ``/generate``, streamed or not, a stream the harness dropped mid-way, a
call the engine rejected — must finish at once. Also: a rejected call takes no ``seq_no``.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from infra.engine.tiny_model import make_tiny_model
from infra.gateway.gateway import Gateway
from storage.store import Store
from storage.tito_log import table_to_records
from tests.infra.gateway.fixtures import ScriptedEngine, serving

pytestmark = pytest.mark.integration

WITHDRAW_S = 5.0  # a settled session withdraws in well under a second; a stall takes 30 s


@pytest.fixture(scope="module")
def model_dir():
    return make_tiny_model()


@pytest.fixture(scope="module")
def cells(model_dir):
    """Cells a and b; cell c has a KV budget so small that the engine rejects long calls."""
    engines = {
        "a": ScriptedEngine(model_dir, cell_id="a"),
        "b": ScriptedEngine(model_dir, cell_id="b"),
        "c": ScriptedEngine(model_dir, cell_id="c", kv_cache_tokens=256),
    }
    with serving(engines) as urls:
        yield engines, urls


@pytest.fixture
def gw(tmp_path, cells, model_dir):
    engines, urls = cells
    for e in engines.values():
        e.replies.clear()
    g = Gateway(
        Store(str(tmp_path / "store")),
        run_id="run-p",
        tokenizer_dir=model_dir,
        spool_dir=str(tmp_path / "spool"),
        admin_token="admin",
    )
    g.add_engine("a", urls["a"])
    g.add_engine("b", urls["b"])
    g.start()
    yield g
    g.stop()


def _session(gw: Gateway) -> tuple[str, str, str]:
    """A session placed on its cell by a first call; (session id, key, cell)."""
    sid, key = gw.new_session()
    r = httpx.post(
        gw.url + "/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "gyre", "prompt": "Hello", "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
    return sid, key, gw.sessions.get(sid).cell_id


def _withdraw(gw: Gateway, cell: str, urls: dict) -> dict:
    t = time.monotonic()
    info = gw.remove_engine(cell, drain_timeout=2.0)
    took = time.monotonic() - t
    assert took < WITHDRAW_S, f"withdrawal of {cell} took {took:.1f} s (a call left unsettled?)"
    gw.add_engine(cell, urls[cell])
    return info


def _sse(lines) -> list[dict]:
    out = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


CALLS = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    "completions": ("/v1/completions", {"prompt": "Once upon a time"}),
    "generate": ("/generate", {"input_ids": [300, 301, 302, 303]}),
}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("kind", sorted(CALLS))
def test_withdrawal_right_after_each_kind_of_call(gw, cells, kind, stream):
    _, urls = cells
    sid, key, cell = _session(gw)
    path, body = CALLS[kind]
    if kind == "generate":
        body = {**body, "sampling_params": {"max_new_tokens": 3}, "stream": stream}
    else:
        body = {**body, "model": "gyre", "max_tokens": 3, "stream": stream}
    r = httpx.post(gw.url + path, headers={"Authorization": f"Bearer {key}"}, json=body)
    assert r.status_code == 200, r.text
    if stream:
        assert _sse(r.text.splitlines()), r.text
    info = _withdraw(gw, cell, urls)
    assert info["sessions_moved"] == 1 and info["kv_moves"] == 1
    assert gw.sessions.get(sid).unrecorded == 0
    gw.flush()
    recs = [x for x in table_to_records(gw.store.read("tito")) if x.session_id == sid]
    assert sorted(x.seq_no for x in recs) == [0, 1]


def test_withdrawal_after_a_dropped_stream(gw, cells):
    """The harness hangs up mid-stream: generation stops, nothing is left unsettled."""
    engines, urls = cells
    sid, key, cell = _session(gw)
    engines[cell].replies.append([300 + (i % 50) for i in range(400)])
    before = set(engines[cell].requests)
    body = {"model": "gyre", "prompt": "Count", "max_tokens": 300, "stream": True}
    sock = socket.create_connection((gw.host, gw.port))
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {key}\r\ncontent-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    got = b""
    while got.count(b"data: ") < 3:  # a few chunks in: the call is generating
        got += sock.recv(65536)
    sock.close()
    deadline = time.monotonic() + 10
    while gw.sessions.get(sid).inflight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gw.sessions.get(sid).inflight == 0  # the engine call was stopped
    (rid,) = set(engines[cell].requests) - before
    assert len(engines[cell].requests[rid].output_ids) < 300  # stopped, not run to the end
    _withdraw(gw, cell, urls)
    assert gw.sessions.get(sid).unrecorded == 0


def test_engine_rejection_settles_and_takes_no_seq_no(gw, cells):
    """A call the engine rejects (4xx) answers 400, plain and streamed; the withdrawal of its
    cell does not stall, and the session's next recorded call has the next seq_no."""
    _engines, urls = cells
    gw.add_engine("c", urls["c"])
    sid, key = gw.new_session()
    gw.remove_engine("a", drain_timeout=0)
    gw.remove_engine("b", drain_timeout=0)  # only c takes new sessions
    try:
        h = {"Authorization": f"Bearer {key}"}
        ok = {"model": "gyre", "prompt": "Hi", "max_tokens": 2}
        assert httpx.post(gw.url + "/v1/completions", headers=h, json=ok).status_code == 200
        too_big = {**ok, "max_tokens": 1000}  # over c's KV budget
        r = httpx.post(gw.url + "/v1/completions", headers=h, json=too_big)
        assert r.status_code == 400 and "rejected" in r.json()["error"]["message"], r.text
        r = httpx.post(gw.url + "/v1/completions", headers=h, json={**too_big, "stream": True})
        events = _sse(r.text.splitlines())
        assert r.status_code == 200 and "rejected" in events[-1]["error"]["message"]
        assert httpx.post(gw.url + "/v1/completions", headers=h, json=ok).status_code == 200
    finally:
        gw.add_engine("a", urls["a"])
        gw.add_engine("b", urls["b"])
    t = time.monotonic()
    gw.remove_engine("c", drain_timeout=2.0)
    assert time.monotonic() - t < WITHDRAW_S
    assert gw.sessions.get(sid).unrecorded == 0
    gw.flush()
    recs = [x for x in table_to_records(gw.store.read("tito")) if x.session_id == sid]
    assert sorted(x.seq_no for x in recs) == [0, 1]  # the rejected calls left no gap


def test_bad_bodies_are_4xx_naming_the_field_and_take_no_seq_no(gw):
    sid, key = gw.new_session()
    h = {"Authorization": f"Bearer {key}"}
    chat = {"model": "gyre", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    cases = [
        ("/generate", {"input_ids": [5, 6], "stream": "no"}, "stream"),
        (
            "/generate",
            {"input_ids": [5, 6], "sampling_params": {"top_p": 0}},
            "sampling_params.top_p",
        ),
        ("/v1/chat/completions", {**chat, "top_p": 0}, "top_p"),
        ("/v1/chat/completions", {**chat, "max_tokens": 2.5}, "max_tokens"),
        ("/v1/chat/completions", {**chat, "temperature": True}, "temperature"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": 3}]}, "messages[0].role"),
        ("/v1/completions", {"model": "gyre", "prompt": "x", "stream": 1}, "stream"),
        ("/v1/completions", {"model": "gyre", "prompt": ["a", "b"]}, "prompt"),
    ]
    for path, body, param in cases:
        r = httpx.post(gw.url + path, headers=h, json=body)
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and param in err["message"], (body, err)
    r = httpx.post(gw.url + "/v1/chat/completions", headers=h, json=chat)
    assert r.status_code == 200, r.text
    gw.flush()
    recs = [x for x in table_to_records(gw.store.read("tito")) if x.session_id == sid]
    assert [x.seq_no for x in recs] == [0]


def test_responses_are_not_held_back_by_nagle(gw):
    """Keep-alive calls on one connection answer in well under Nagle's ~40 ms delayed-ACK
    stall (the response head and body leave in two writes)."""
    sock = socket.create_connection((gw.host, gw.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(30):
        t = time.perf_counter()
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n")
        buf = b""
        while b"}" not in buf:
            buf += sock.recv(4096)
        times.append(time.perf_counter() - t)
    sock.close()
    assert sorted(times)[15] < 0.02, sorted(times)
