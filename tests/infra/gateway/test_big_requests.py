"""One request must not stall the gateway for everyone (issue 26 §2).

A body of several MB is legitimate at gyre's ~1M-token contexts (a harness re-sends its whole
conversation), so the gateway takes it, but it never parses, renders or tokenizes it on the
event loop: ``/health`` (and every other session) answers within a second while it works. A
body that cannot fit the model's context is refused from its length alone, before the
tokenizer runs (a 10 MB body on a 32K-token model: milliseconds, not a minute).
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from infra.engine.engine import Engine
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.gateway import Gateway
from storage.store import Store
from tests.infra.gateway.fixtures import serving

pytestmark = pytest.mark.integration

LONG_CONTEXT = 262_144  # a long-context tiny model (the same weights recipe, more positions)


def _gateway(tmp_path, model_dir: str, url: str, **kw) -> Gateway:
    gw = Gateway(
        Store(str(tmp_path / "store")),
        run_id="run-big",
        tokenizer_dir=model_dir,
        spool_dir=str(tmp_path / "spool"),
        **kw,
    )
    gw.add_engine("a", url)
    gw.start()
    return gw


def _health_during(gw: Gateway, send) -> tuple[httpx.Response, float, list[float]]:
    """Run ``send()`` on a thread; probe ``/health`` back to back meanwhile. Returns its
    response, how long it took, and how long each probe waited: from the end of the one
    before (or the start) to its answer, so that a stall of the whole process (a C call
    holding the GIL stops this prober too) counts as well as a busy event loop."""
    out: dict = {}

    def call() -> None:
        t0 = time.monotonic()
        try:
            out["r"] = send()
        finally:
            out["s"] = time.monotonic() - t0

    th = threading.Thread(target=call)
    waits: list[float] = []
    with httpx.Client(base_url=gw.url, timeout=120) as c:
        last = time.monotonic()
        th.start()
        while th.is_alive():
            assert c.get("/health").status_code == 200
            now = time.monotonic()
            waits.append(now - last)
            last = now + 0.02  # the pause is the prober's, not the server's (a stall of the
            time.sleep(0.02)  # process during it still counts: it delays the next answer)
    th.join()
    return out["r"], out["s"], waits


def _chat(gw: Gateway, key: str, text: str) -> httpx.Response:
    body = {"model": "gyre", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    return httpx.post(
        gw.openai_base_url + "/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=300,
    )


@pytest.fixture(scope="module")
def short_model():
    """The tiny model (32768-token context) behind a real engine server."""
    model_dir = make_tiny_model()
    with serving({"a": Engine(model_dir, cell_id="a")}) as urls:
        yield model_dir, urls["a"]


@pytest.fixture(scope="module")
def long_model():
    """The tiny model with a 262144-token context behind a real engine server."""
    model_dir = make_tiny_model(max_position_embeddings=LONG_CONTEXT)
    with serving({"a": Engine(model_dir, cell_id="a")}) as urls:
        yield model_dir, urls["a"]


def test_a_10mb_body_is_refused_from_its_length_while_health_answers(tmp_path, short_model):
    """10 MB of text on a 32768-token model: the tokenizer's longest token is 13 characters, so the
    text is at least 769K tokens; refused with 400 context_length_exceeded before it is
    tokenized (today: 6M tokens tokenized on the event loop first, /health blocked)."""
    gw = _gateway(tmp_path, *short_model)
    try:
        _, key = gw.new_session()
        text = "word " * 2_000_000  # 10 MB
        r, took, lat = _health_during(gw, lambda: _chat(gw, key, text))
        print(f"10 MB body: {r.status_code} in {took:.2f} s; /health max {max(lat):.3f} s")
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
        assert "32768" in err["message"] and "at least" in err["message"]
        assert max(lat) < 1.0, f"/health took {max(lat):.2f} s during the 10 MB body"
        assert took < 5.0, f"the 10 MB body took {took:.1f} s to refuse"
        gw.flush()
        assert gw.counters["calls"] == 0  # nothing answered, nothing recorded
    finally:
        gw.stop()


def test_health_answers_while_a_big_body_is_tokenized(tmp_path, long_model):
    """A 3 MB body on a 262144-token model: its length alone does not prove it too long, so
    it is rendered and tokenized (1.8M tokens, seconds of CPU) off the event loop, then
    refused from its exact count; /health answers in under a second all along, and a small
    call of another session is answered meanwhile."""
    gw = _gateway(tmp_path, *long_model)
    try:
        _, key = gw.new_session()
        _, other = gw.new_session()
        text = (
            "word " * 600_000
        )  # 3 MB: 1.8M tokens of the tiny vocabulary (13 characters at most each)
        small: list[httpx.Response] = []

        def both() -> httpx.Response:
            th = threading.Thread(target=lambda: small.append(_chat(gw, other, "hello")))
            t = threading.Timer(0.3, th.start)
            t.start()
            r = _chat(gw, key, text)
            t.join()
            th.join()
            return r

        r, took, lat = _health_during(gw, both)
        print(f"3 MB body: {r.status_code} in {took:.2f} s; /health max {max(lat):.3f} s")
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded"
        n_in = int(re.search(r"the input has (\d+)\.", err["message"]).group(1))
        assert 1_800_000 < n_in < 1_800_100  # counted exactly: tokenized, then refused
        assert small[0].status_code == 200, small[0].text[:300]
        assert len(lat) >= 5, f"only {len(lat)} probes during a {took:.1f} s request"
        assert max(lat) < 1.0, f"/health took {max(lat):.2f} s during the big body"
    finally:
        gw.stop()


def test_a_body_over_the_cap_is_413_before_it_is_read(tmp_path, short_model):
    gw = _gateway(tmp_path, *short_model, max_body_bytes=1 << 20)
    try:
        _, key = gw.new_session()
        t0 = time.monotonic()
        r = _chat(gw, key, "word " * 2_000_000)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        assert time.monotonic() - t0 < 5.0
    finally:
        gw.stop()
