"""Serve to train: sessions a user's harness ran through `gyre serve`, scored through the
documented call (`POST /gyre/scores` with the session's key), exported with their text,
then trained on by `gyre run --from-served` (their tokens in `ledger` and `steps`)."""

from __future__ import annotations

import json
import signal
import subprocess

import httpx
import pyarrow.parquet as pq
import pytest

from storage.sql import query
from storage.store import Store
from tests.flows.test_serve_cli import GYRE, _chat, _serve, _session, _wait_up, env  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _score(sess: dict, score: float) -> dict:
    """The documented score call (README: serve, score, train)."""
    gateway = sess["base_url"].removesuffix("/v1")
    r = httpx.post(
        f"{gateway}/gyre/scores",
        headers={"Authorization": f"Bearer {sess['api_key']}"},
        json={"subtask_id": "answer", "score": score},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_a_served_and_scored_session_is_trained_on(tmp_path, free_port, env):  # noqa: F811
    store = str(tmp_path / "store")
    port = free_port()
    proc = _serve(env, store, port)
    try:
        _wait_up(proc, tmp_path / "cache" / "serve" / f"{port}.json")
        good, bad, unscored = (json.loads(_session(env).stdout) for _ in range(3))
        for sess, text in ((good, "What is 2 + 2?"), (bad, "What is 3 + 5?"),
                           (unscored, "Hello")):  # fmt: skip
            _chat(sess, text)
        assert _score(good, 1.0)["n"] == 1 and _score(bad, 0.0)["n"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)  # flushes the answered calls to the store
        proc.communicate(timeout=120)
    st = Store(store)
    # the transcript of the worst session reads as text, in the run's own tokenizer
    (worst,) = query(
        st,
        "SELECT t.session_id, t.text FROM transcripts t JOIN scores s USING (run_id, session_id) "
        "ORDER BY s.score LIMIT 1",
    ).to_pylist()
    assert worst["session_id"] == bad["session_id"] and "What is 3 + 5?" in worst["text"]
    # gyre export works on a serve run, with text columns
    out = tmp_path / "served.parquet"
    ex = subprocess.run([*GYRE, "export", "serve", "--store", store, "--out", str(out)],
                        env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert ex.returncode == 0, ex.stderr
    rows = pq.read_table(out).to_pylist()
    assert {r["session_id"] for r in rows} == {s["session_id"] for s in (good, bad, unscored)}
    assert any("What is 2 + 2?" in r["prompt_text"] for r in rows)
    # the documented training on served sessions
    run = subprocess.run(
        [*GYRE, "run", "--from-served", "serve", "--store", store, "train.lr=0.01"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    steps = query(st, "SELECT step, weight_version, tokens FROM steps").to_pylist()
    assert len(steps) == 1 and steps[0]["step"] == 0 and steps[0]["weight_version"] == 1
    assert steps[0]["tokens"] > 0
    trained = {r["sample_id"].split("/")[2] for r in query(st, "SELECT sample_id FROM ledger")
               .to_pylist()}  # fmt: skip
    assert trained == {good["session_id"], bad["session_id"]}  # the unscored one waits
    assert st.exists("checkpoints/serve/v1/COMPLETE")
    # a second pass has nothing new to train on, and says so
    again = subprocess.run([*GYRE, "run", "--from-served", "serve", "--store", store],
                           env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert again.returncode == 2 and "no scored session" in again.stderr
