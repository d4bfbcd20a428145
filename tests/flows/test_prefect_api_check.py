"""``gyre run`` with a ``PREFECT_API_URL`` that nothing answers at (issue 26 §3): one line
naming the variable and the two ways out, exit 2, before anything is created (it was a
traceback from the flow's first API call, ~20 s in, with the store already made)."""

from __future__ import annotations

import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from flows.preflight import check_prefect_api
from tests.flows.test_bad_input import _gyre, _refused

pytestmark = pytest.mark.integration


@pytest.fixture()
def dead_url():
    with socket.socket() as s:  # a port nothing listens on (bound, never listening)
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}/api"


def _env(url: str) -> dict:
    return {**os.environ, "PREFECT_API_URL": url}


def test_a_dead_prefect_api_is_one_line_and_creates_nothing(tmp_path, dead_url):
    store = tmp_path / "s"
    res = _gyre("run", "--store", str(store), env=_env(dead_url), timeout=60)
    _refused(res, f"PREFECT_API_URL={dead_url!r}", "unset PREFECT_API_URL", "prefect server start")
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not store.exists()


def test_with_config_problems_all_are_listed_and_nothing_created(tmp_path, dead_url):
    store = tmp_path / "s"
    res = _gyre("run", "--store", str(store), "train.stepz=3", env=_env(dead_url), timeout=60)
    _refused(res, "PREFECT_API_URL=", "did you mean 'train.steps'")
    assert not store.exists()


def test_resume_checks_it_too(tmp_path, dead_url):
    res = _gyre("run", "--resume", "r1", "--store", str(tmp_path / "s"), env=_env(dead_url))
    _refused(res, "PREFECT_API_URL=", "--resume r1")


class _NotFound(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_unset_or_answering_apis_pass():
    assert check_prefect_api(None) is None and check_prefect_api("") is None
    server = HTTPServer(("127.0.0.1", 0), _NotFound)  # any reply: a server is there
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert check_prefect_api(f"http://127.0.0.1:{server.server_port}/api") is None
    finally:
        server.shutdown()
        server.server_close()
    assert "no Prefect API answers" in check_prefect_api("not a url")
