"""`gyre serve` + `gyre session new`: a user's own harness against the gateway, then SQL;
and what survives stopping the server by SIGTERM, SIGINT in a background job, or SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

GYRE = [sys.executable, "-m", "flows.cli"]  # the console script, from this venv


def _serve(env: dict, store: str, port: int, *extra: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [*GYRE, "serve", "--store", store, "--port", str(port), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


def _wait_up(proc: subprocess.Popen, record: Path) -> None:
    """Until this process's record is there (a killed server's stale one does not count)."""
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "gyre serve did not come up"
        try:
            if json.loads(record.read_text())["pid"] == proc.pid:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.3)


def _session(env: dict, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*GYRE, "session", "new", *extra], env=env, capture_output=True, text=True
    )


def _chat(sess: dict, text: str = "What is 2 + 2?"):
    client = openai.OpenAI(base_url=sess["base_url"], api_key=sess["api_key"], max_retries=0)
    return client.chat.completions.create(
        model="gyre", messages=[{"role": "user", "content": text}], max_tokens=8
    )


def _tito_rows(store: str) -> list[dict]:
    out = subprocess.run(
        [*GYRE, "sql", "--store", store, "--format", "json",
         "SELECT session_id, request_id, len(output_ids) AS n_out FROM tito"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [json.loads(line) for line in out.splitlines()]


@pytest.fixture()
def env(tmp_path):
    return {**os.environ, "GYRE_CACHE": str(tmp_path / "cache")}


def test_serve_session_chat_then_sql(tmp_path, free_port, env):
    store = str(tmp_path / "store")
    port = free_port()
    record = tmp_path / "cache" / "serve" / f"{port}.json"
    proc = _serve(env, store, port, "--max-body-mb", "1")
    try:
        _wait_up(proc, record)
        assert oct(record.stat().st_mode & 0o777) == "0o600"  # it holds the admin token
        sess = json.loads(_session(env).stdout)
        assert sess["base_url"] == f"http://127.0.0.1:{port}/v1"
        r = _chat(sess)
        assert r.choices[0].finish_reason in ("stop", "length")
        # --max-body-mb 1: a 1.5 MiB body is refused unread, and nothing is recorded
        big = httpx.post(
            sess["base_url"] + "/chat/completions",
            content=b'{"model": "gyre", "messages": [{"role": "user", "content": "'
            + b"x" * (3 << 19)
            + b'"}]}',
            headers={"Authorization": f"Bearer {sess['api_key']}",
                     "content-type": "application/json"},
            timeout=60,
        )  # fmt: skip
        assert big.status_code == 413, big.text
        bad = openai.OpenAI(base_url=sess["base_url"], api_key="not-a-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="gyre", messages=[{"role": "user", "content": "x"}])
        # a second server on the same port is refused, before loading anything
        second = subprocess.run(
            [*GYRE, "serve", "--store", store, "--port", str(port)],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 2 and "already answers" in second.stderr
        assert record.exists()
    finally:
        proc.send_signal(signal.SIGINT)
        banner = proc.communicate(timeout=60)[0]
    assert "base URL" in banner and "gyre session new" in banner
    # never silent before the banner: each phase is named, in order, with its time
    phases = ["importing torch", "loading ", "matching its weights", "starting the gateway"]
    at = [banner.find(f"gyre serve: {p}") for p in phases]
    assert min(at) >= 0 and at == sorted(at) and at[-1] < banner.find("base URL"), banner
    assert not record.exists()
    rows = _tito_rows(store)
    assert len(rows) == 1 and rows[0]["request_id"] == r.id
    assert rows[0]["session_id"] == sess["session_id"] and rows[0]["n_out"] >= 1
    # the server is gone: a clear error, no traceback
    gone = _session(env)
    assert gone.returncode == 2 and "no running `gyre serve`" in gone.stderr
    assert "Traceback" not in gone.stderr


@pytest.mark.fault
def test_sigterm_and_sigkill_lose_no_answered_call(tmp_path, free_port, env):
    store = str(tmp_path / "store")
    port = free_port()
    record = tmp_path / "cache" / "serve" / f"{port}.json"
    # started like `gyre serve &` from a script: SIGINT ignored by the shell
    proc = _serve(env, store, port, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    _wait_up(proc, record)
    sess = json.loads(_session(env).stdout)
    ids = [_chat(sess, f"call {i}").id for i in range(5)]
    proc.send_signal(signal.SIGINT)  # still stops it
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert sorted(r["request_id"] for r in _tito_rows(store)) == sorted(ids)

    # the same store again: the old key still works; then SIGKILL right after answers
    proc = _serve(env, store, port)
    _wait_up(proc, record)
    more = [_chat(sess, f"again {i}").id for i in range(3)]
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert len(_tito_rows(store)) == 8

    proc = _serve(env, store, port)
    _wait_up(proc, record)
    last = [_chat(sess, f"last {i}").id for i in range(2)]
    proc.kill()  # no flush: the answered calls are only in the write-ahead log
    proc.communicate(timeout=60)
    proc = _serve(env, store, port)  # a stale record is cleaned, the log replayed
    _wait_up(proc, record)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    rows = _tito_rows(store)
    assert sorted(r["request_id"] for r in rows) == sorted(ids + more + last)


def test_bad_model_and_busy_port_are_refused_before_the_engine(tmp_path, env):
    """Both problems named at once, before torch is imported (that import took up to a
    minute under load before the port was even looked at); nothing created."""
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    store = tmp_path / "store"
    t0 = time.monotonic()
    try:
        res = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "flows.cli", "serve", "--model", "/nope",
             "--port", str(port), "--store", str(store)],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        busy.close()
    assert time.monotonic() - t0 < 30
    assert res.returncode == 2, res.stderr[-3000:]
    err = res.stderr
    assert "Traceback" not in err
    assert "--model /nope: no such directory" in err and "leave --model out" in err
    assert f"--port {port}: port {port} is in use" in err and "pick another --port" in err
    imported = {line.rsplit("|", 1)[-1].strip() for line in err.splitlines() if "|" in line}
    assert not imported & {"torch", "transformers", "infra.engine.engine"}
    assert not store.exists()
