"""A gateway process killed with SIGKILL mid-session loses no answered call (slow: a process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import openai
import pytest

from infra.engine.server import EngineServer
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.gateway import Gateway
from storage.store import Store
from storage.tito import reconstruct_inputs
from storage.tito_log import table_to_records
from tests.infra.gateway.fixtures import ScriptedEngine

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.parametrize("fsync", [True, False])
def test_sigkill_mid_session_loses_no_answered_call(tmp_path, fsync):
    model = make_tiny_model()
    eng = ScriptedEngine(model, cell_id="e")
    srv = EngineServer(eng)
    url = srv.start()
    store_dir, spool = str(tmp_path / "store"), str(tmp_path / "spool")
    child = textwrap.dedent(
        f"""
        import sys, threading
        from infra.gateway.gateway import Gateway
        from storage.store import Store
        gw = Gateway(Store({store_dir!r}), run_id="crash", tokenizer_dir={model!r},
                     spool_dir={spool!r}, flush_seconds=3600, wal_fsync={fsync})
        gw.add_engine("e", {url!r})
        base = gw.start()
        sid, key = gw.new_session()
        print(base, key, flush=True)
        threading.Event().wait()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        base, key = proc.stdout.readline().split()
        client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
        msgs = [{"role": "user", "content": "Begin."}]
        answered = []
        for turn in range(4):
            r = client.chat.completions.create(model="gyre", messages=msgs, max_tokens=3)
            answered.append(r.id)
            msgs += [
                r.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": f"Step {turn}."},
            ]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        store = Store(store_dir)
        assert store.read("tito").num_rows == 0  # nothing had been flushed
        gw = Gateway(store, run_id="crash", tokenizer_dir=model, spool_dir=spool)
        gw.add_engine("e", url)
        gw.start()
        try:
            assert sorted(store.read("tito").column("request_id").to_pylist()) == sorted(answered)
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
            r = client.chat.completions.create(model="gyre", messages=msgs, max_tokens=3)
        finally:
            gw.stop()
        recs = {x.request_id: x for x in table_to_records(store.read("tito"))}
        assert set(recs) == {*answered, r.id}
        assert recs[r.id].parent_request_id == answered[-1] and recs[r.id].seq_no == 4
        full = reconstruct_inputs(recs.values())
        for rid, rec in recs.items():
            assert full[rid].tolist() == eng.received[rid]  # what the engine was sent
            assert len(rec.output_ids) == len(rec.output_logprobs)
    finally:
        if proc.poll() is None:
            proc.kill()
        srv.stop()
        eng.close()
