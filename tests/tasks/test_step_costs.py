"""A member's measured parts of a step (``TrainedStep.costs``, issue 25: each cost per step
kept in ``cells``): what the executor writes into the member's ``step_done`` row.

One member (world 1, gloo) in the test process, three steps: the first forms its DP group
and loads its replica from the checkpoint; the second, of the same generation, forms
nothing and keeps its replica; the third, a new generation, forms again. Every part is
measured on the member (never a default), ``begin_t`` is the member's wall-clock start,
and rank 0's commit is timed.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from storage.store import Store
from tasks.train import dp
from tasks.train_step import SYNC_CODES, load_samples, member_step
from tests.tasks.test_dp_step import CFG, RUN, _store_with_batch


@pytest.fixture
def three_batches(tmp_path):
    store, seg = _store_with_batch(tmp_path, "qwen3")
    rows = [s.to_row() for s in load_samples(store, seg)]
    return store, [store.append("samples", rows[k : k + 2]) for k in (0, 2, 4)]


def test_a_members_costs_are_measured_and_a_kept_generation_forms_nothing(three_batches):
    store, segs = three_batches
    _server, port = dp.host_store("127.0.0.1", 0, timeout_s=60)
    holder = SimpleNamespace(dp=None, trainer=None, trainer_run=None, trainer_key=None)
    done = []
    try:
        for step, gen in enumerate((0, 0, 1)):
            plan = dp.StepPlan(step, step, gen, "127.0.0.1", port, ("c0",), (step,), (segs[step],))
            t0 = time.time()
            out = member_step(Store(store.url), RUN, plan, 0, CFG, holder=holder, backend="gloo")
            done.append((t0, time.time(), out))
    finally:
        if holder.dp is not None:
            holder.dp.close()
    syncs = [out.metrics["train/dp_sync"] for _, _, out in done]
    assert syncs == [SYNC_CODES["checkpoint"], SYNC_CODES["kept"], SYNC_CODES["kept"]]
    for t0, t1, out in done:
        c = out.costs
        assert set(c) == {"begin_t", "form_s", "sync_s", "train_s", "commit_s"}, c
        assert t0 <= c["begin_t"] <= t1
        parts = c["form_s"] + c["sync_s"] + c["train_s"] + c["commit_s"]
        assert all(c[k] >= 0 for k in ("form_s", "sync_s", "train_s", "commit_s"))
        assert parts <= t1 - c["begin_t"] + 1e-3  # parts of the member's own time
        assert c["train_s"] > 0 and c["commit_s"] > 0  # a forward/backward, a checkpoint
    form = [out.costs["form_s"] for _, _, out in done]
    assert form[0] > 0 and form[2] > 0, form  # a group formed: generation 0, then 1
    assert form[1] == 0.0, form  # the same generation: nothing formed
    # loading the replica from the checkpoint costs more than keeping it
    assert done[0][2].costs["sync_s"] > done[1][2].costs["sync_s"]
