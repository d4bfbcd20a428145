"""Fast: per-sub-task credit on retries, through the real harness, arith suite, gateway,
engine and processing (scripted replies play the agent), checked against a hand-computed
case.

Task: sub-tasks s0, s1 (weight 1 each), 2 attempts per turn, ``normalize_std=False``.

- rollout A: s0 answered "no" (0, retried), then right (1); s1 right (1).
  Calls A1 (s0, 0), A2 (s0, 1: a sibling of A1), A3 (s1, 1: extends A2).
- rollout B: s0 answered off by one (0.5), retried off by three (0.25: the better first
  attempt keeps the credit); s1 right. Calls B1 (s0), B2 (s0 again: a sibling), B3 (s1:
  extends B2, the attempt kept in the history).

Scores: A s0 = 1 at A2, s1 = 1 at A3; B s0 = 0.5 at B1, s1 = 1 at B3.
Normalised per sub-task over the group: s0 [1, 0.5] -> A +0.25, B -0.25; s1 [1, 1] -> 0.
A branch gets, per sub-task, half (weight share) the term of the deepest attempt on its path:
leaf A1: 0; leaf A3 (path A2, A3): +0.125; leaf B1: -0.125; leaf B3 (path B2, B3): 0.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from infra.engine.server import EngineServer
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.gateway import Gateway
from storage.store import Store
from storage.tito import reconstruct_inputs
from storage.tito_log import table_to_records
from tasks.env.arith import make_task
from tasks.env.config import RolloutConfig
from tasks.handles import GroupSpec
from tasks.process import process_sessions
from tasks.rollout import roll_out_group
from tasks.train_step import load_samples
from tests.infra.gateway.fixtures import ScriptedEngine

pytestmark = pytest.mark.integration

ADMIN = "admin-retry"
RUN = "run-retry"
SEED = 4


def test_retried_subtask_credit_by_hand(tmp_path):
    model_dir = make_tiny_model()
    engine = ScriptedEngine(model_dir, cell_id="a")
    server = EngineServer(engine)
    url = server.start()
    store = Store(str(tmp_path / "store"))
    gw = Gateway(
        store, run_id=RUN, tokenizer_dir=model_dir, spool_dir=str(tmp_path / "spool"),
        admin_token=ADMIN,
    )  # fmt: skip
    gw.add_engine("a", url)
    gw.start()
    _, subs = make_task(SEED, 2, 1)
    a0, a1 = subs[0].answer, subs[1].answer
    cfg = RolloutConfig(suite="arith", group_size=1, subtasks=2, max_attempts=2, max_new_tokens=8)
    handles, calls = [], {}
    try:
        for name, replies in (
            ("A", ["no", f"{a0}", f"{a1}"]),
            ("B", [f"{a0 + 1}", f"{a0 + 3}", f"{a1}"]),
        ):
            engine.replies.clear()
            engine.replies.extend(gw.tok.encode(r) for r in replies)
            spec = GroupSpec(index=0, group_id=f"g{name}", task_seed=SEED, subtasks=2)
            (h,) = roll_out_group(gw.url, ADMIN, store, RUN, spec, cfg)
            assert not engine.replies and h.calls == 3, (name, h)
            handles.append(replace(h, group_id="g"))  # one GRPO group of the two
            gw.flush()
            recs = [r for r in table_to_records(store.read("tito")) if r.session_id == h.session_id]
            calls[name] = sorted(recs, key=lambda r: r.seq_no)
    finally:
        gw.stop()
        server.stop()
        engine.close()
    ra, rb = ([r.request_id for r in calls[n]] for n in "AB")
    scores = {(s["session_id"], s["subtask_id"]): s for s in store.read("scores").to_pylist()}
    sa, sb = (h.session_id for h in handles)
    assert (scores[sa, "s0"]["score"], scores[sa, "s0"]["at_request_id"]) == (1.0, ra[1])
    assert (scores[sa, "s1"]["score"], scores[sa, "s1"]["at_request_id"]) == (1.0, ra[2])
    assert (scores[sb, "s0"]["score"], scores[sb, "s0"]["at_request_id"]) == (0.5, rb[0])
    assert (scores[sb, "s1"]["score"], scores[sb, "s1"]["at_request_id"]) == (1.0, rb[2])
    # the retries are branches: A2 and B2 start from their first attempt's input
    assert calls["A"][1].parent_request_id == ra[0] and calls["B"][1].parent_request_id == rb[0]
    # the attempt a turn ends with (the last, or the first good one) is the history the next
    # turn extends: its whole input and output are the next call's prefix
    inputs = reconstruct_inputs(calls["A"] + calls["B"])
    for name, rids in (("A", ra), ("B", rb)):
        kept, nxt = calls[name][1], calls[name][2]
        assert nxt.parent_request_id == rids[1]
        assert nxt.prefix_len == len(inputs[rids[1]]) + len(kept.output_ids), name

    out = process_sessions(
        store, RUN, 0, handles, current_version=0, advantage="per_subtask", normalize_std=False
    )
    samples = {s.session_id: s for s in load_samples(store, out.samples_segment)}
    n_out = {n: [len(r.output_ids) for r in calls[n]] for n in "AB"}

    def weights(sid):
        s = samples[sid]
        w = s.weight_pos + s.weight_neg
        return np.round(w[w != 0], 9).tolist(), float(s.weight_neg.sum())

    # A: the tokens of A2 and A3 carry +0.125; A1's (the failed attempt) nothing
    wa, neg_a = weights(sa)
    assert wa == [0.125] * (n_out["A"][1] + n_out["A"][2]) and neg_a == 0.0
    # B: only B1's tokens (where the 0.5 was earned) carry -0.125
    wb, neg_b = weights(sb)
    assert wb == [-0.125] * n_out["B"][0]
    assert neg_b == pytest.approx(-0.125 * n_out["B"][0])
