"""`gyre serve` + `gyre session new`: a user's own harness against the gateway, then SQL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import openai
import pytest

pytestmark = pytest.mark.integration

GYRE = [sys.executable, "-m", "flows.cli"]  # the console script, from this venv


def test_serve_session_chat_then_sql(tmp_path, free_port):
    env = {**os.environ, "GYRE_CACHE": str(tmp_path / "cache")}
    store = str(tmp_path / "store")
    port = free_port()
    proc = subprocess.Popen(
        [*GYRE, "serve", "--store", store, "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        serve_file = tmp_path / "cache" / "serve.json"
        deadline = time.monotonic() + 120
        while not serve_file.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "gyre serve did not come up"
            time.sleep(0.5)
        out = subprocess.run(
            [*GYRE, "session", "new"], env=env, capture_output=True, text=True, check=True
        ).stdout
        sess = json.loads(out)
        assert sess["base_url"] == f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=sess["base_url"], api_key=sess["api_key"], max_retries=0)
        r = client.chat.completions.create(
            model="gyre", messages=[{"role": "user", "content": "What is 2 + 2?"}], max_tokens=8
        )
        assert r.choices[0].finish_reason in ("stop", "length")
        bad = openai.OpenAI(base_url=sess["base_url"], api_key="not-a-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="gyre", messages=[{"role": "user", "content": "x"}])
    finally:
        proc.send_signal(signal.SIGINT)
        banner = proc.communicate(timeout=60)[0]
    assert "base URL" in banner and "gyre session new" in banner
    assert not (tmp_path / "cache" / "serve.json").exists()
    out = subprocess.run(
        [
            *GYRE,
            "sql",
            "--store",
            store,
            "--format",
            "json",
            "SELECT session_id, request_id, len(output_ids) AS n_out FROM tito",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 1 and rows[0]["request_id"] == r.id
    assert rows[0]["session_id"] == sess["session_id"] and rows[0]["n_out"] >= 1
