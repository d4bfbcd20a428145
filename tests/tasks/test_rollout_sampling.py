"""Fast: the rollout section's sampling settings reach the engine through the rollout task,
the harness and the gateway. Greedy rollouts (temperature 0) generate the model's argmax
(checked by a plain forward of the model); sampled rollouts of one group draw with their
own seeds, so sessions given the same prompt still differ (a group of identical sessions
has no learning signal)."""

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
from tasks.handles import GroupSpec
from tasks.rollout import roll_out_group

pytestmark = pytest.mark.integration

ADMIN = "admin-rs"
RUN = "run-rs"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("rs")
    model_dir = make_tiny_model()
    engine = Engine(model_dir, cell_id="a")
    server = EngineServer(engine)
    url = server.start()
    gw = Gateway(
        Store(str(root / "store")), run_id=RUN, tokenizer_dir=model_dir,
        spool_dir=str(root / "spool"), admin_token=ADMIN,
    )  # fmt: skip
    gw.add_engine("a", url)
    gw.start()
    yield gw, model_dir
    gw.stop()
    server.stop()
    engine.close()


def _roll(gw, cfg: RolloutConfig, group: str):
    spec = GroupSpec(index=0, group_id=group, task_seed=9, subtasks=cfg.subtasks)
    handles = roll_out_group(gw.url, ADMIN, gw.store, RUN, spec, cfg)
    gw.flush()
    sids = {h.session_id for h in handles}
    recs = [r for r in table_to_records(gw.store.read("tito")) if r.session_id in sids]
    return handles, sorted(recs, key=lambda r: (r.session_id, r.seq_no))


def test_greedy_rollouts_generate_the_argmax(served):
    from transformers import AutoModelForCausalLM

    gw, model_dir = served
    cfg = RolloutConfig(suite="arith", group_size=2, subtasks=1, max_attempts=1, temperature=0.0)
    _, recs = _roll(gw, cfg, "g-greedy")
    assert len(recs) == 2
    inputs = reconstruct_inputs(recs)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for r in recs:
        ids = [int(t) for t in inputs[r.request_id]] + [int(t) for t in r.output_ids]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        k = len(ids) - len(r.output_ids)
        assert list(r.output_ids) == logits[k - 1 : len(ids) - 1].argmax(-1).tolist()


def test_sessions_of_a_group_draw_with_their_own_seeds(served):
    gw, _ = served
    cfg = RolloutConfig(
        suite="arith", group_size=3, subtasks=1, max_attempts=1, temperature=1.0, max_new_tokens=12
    )
    _, recs = _roll(gw, cfg, "g-sampled")
    assert len(recs) == 3
    inputs = reconstruct_inputs(recs)
    assert len({tuple(inputs[r.request_id]) for r in recs}) == 1  # the same prompt
    assert len({tuple(r.output_ids) for r in recs}) == 3  # three different draws
