"""Fast: held-out evaluation is greedy. Every token an evaluation session generated is the
argmax of the served model given what came before it, computed here by a plain forward
of the model (no engine, no cache); the rows in ``evals`` are the sessions' scores and
nothing reaches ``scores`` (evaluations are never trained on)."""

from __future__ import annotations

import pytest
import torch

from infra.engine.engine import Engine
from infra.engine.server import EngineServer
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.gateway import Gateway
from storage.store import Store
from storage.tito import reconstruct_inputs
from storage.tito_log import table_to_records
from tasks.env.config import RolloutConfig
from tasks.env.heldout import EvalConfig
from tasks.evaluate import evaluate_version

pytestmark = pytest.mark.integration

ADMIN = "admin-eval"
RUN = "run-eval"


def test_evaluation_tokens_are_the_greedy_argmax(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model()
    engine = Engine(model_dir, cell_id="a", weight_version=3)
    server = EngineServer(engine)
    url = server.start()
    store = Store(str(tmp_path / "store"))
    gw = Gateway(
        store, run_id=RUN, tokenizer_dir=model_dir, spool_dir=str(tmp_path / "spool"),
        admin_token=ADMIN,
    )  # fmt: skip
    gw.add_engine("a", url)
    gw.start()
    try:
        # sampling rollouts (temperature 1.5) must not make the evaluation sample
        rollout = RolloutConfig(suite="arith", subtasks=2, max_new_tokens=10, temperature=1.5)
        done = evaluate_version(
            gw.url, ADMIN, store, RUN, version=3, step=2, cell_id="a", seeds=[0, 1],
            rollout=rollout, cfg=EvalConfig(tasks=2, concurrency=2),
        )  # fmt: skip
        gw.flush()
    finally:
        gw.stop()
        server.stop()
        engine.close()
    assert done.n == 2 and done.version == 3
    sids = set(done.session_ids)
    records = [r for r in table_to_records(store.read("tito")) if r.session_id in sids]
    assert {r.session_id for r in records} == sids
    assert all(r.weight_version == 3 for r in records)
    inputs = reconstruct_inputs(records)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n = 0
    for r in records:
        ids = [int(t) for t in inputs[r.request_id]] + [int(t) for t in r.output_ids]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        k = len(ids) - len(r.output_ids)
        argmax = logits[k - 1 : len(ids) - 1].argmax(-1).tolist()
        assert list(r.output_ids) == argmax, f"{r.request_id}: not the greedy completion"
        n += len(argmax)
    assert n >= 2 * 2  # at least a token per sub-task
    rows = [x for x in store.read("evals").to_pylist() if x["run_id"] == RUN]
    assert sorted(x["seed"] for x in rows) == [0, 1]
    assert all(x["version"] == 3 and x["step"] == 2 for x in rows)
    # one attempt per turn (eval.max_attempts=1; a greedy retry would only repeat itself)
    assert all(x["n_calls"] == 2 for x in rows), [x["n_calls"] for x in rows]
    assert len(records) == 4
    assert not [x for x in store.read("scores").to_pylist() if x["session_id"] in sids]
