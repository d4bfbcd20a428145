"""The three scheduling modes end to end through the rl_run flow, on a real LocalCluster.

Each run is checked through what a user sees (the SQL views and the run's report files):
the steps were trained, no harness call failed, the ledger holds every consumed sample
exactly once (across the DP group's joins and leaves in elastic), every sample's policy lag
is recorded, every role change is in ``cells`` with its reason, and each mode keeps the lag
bound (``train.max_staleness=1``).
"""

from __future__ import annotations

import pytest

from storage.sql import query
from storage.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]

COMMON = [
    "rollout.group_size=2",
    "rollout.subtasks=2",
    "rollout.groups_per_step=1",
    "cluster.rollout_cells=2",
    "cluster.train_cells=1",
    "scheduler.groups_per_cell=2",
    "scheduler.tick_s=0.1",
    "scheduler.pacing.decode_step_s=0.02",
    "scheduler.pacing.env_step_s=0.2",
    "scheduler.pacing.train_s_per_token=0.001",
]
MODES = {
    "colocate": ["train.steps=2"],
    "async": ["train.steps=3"],
    # tight marks and no dwell: train cells are lent to rollout between steps and come back
    "elastic": [
        "train.steps=5",
        "scheduler.low_mark=0.5",
        "scheduler.high_mark=1.5",
        "scheduler.min_dwell_s=0",
        "scheduler.train_s_per_group=2",
        "scheduler.dp_sync_s=0.05",
    ],
}
# issue 27: the same elastic run with parameters, gradients and AdamW state sharded over
# the step's members (FSDP2), whose number changes as cells move
MODES["elastic-fsdp"] = [*MODES["elastic"], "train.sharding=fsdp"]


def _one(store: Store, sql: str):
    return query(store, sql).to_pylist()[0]


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_end_to_end(prefect_harness, tmp_path, mode):
    from flows.rl_run import rl_run

    store_url = str(tmp_path / "store")
    summary = rl_run(
        preset=None,
        store=store_url,
        overrides=[*COMMON, *MODES[mode], f"scheduler.mode={mode.split('-')[0]}"],
    )
    store = Store(store_url)
    steps = int(MODES[mode][0].split("=")[1])
    assert summary["steps"] == steps and summary["weight_version"] == steps
    rows = query(store, "SELECT * FROM steps ORDER BY step").to_pylist()
    assert [r["weight_version"] for r in rows] == list(range(1, steps + 1))
    assert all(r["mode"] == mode.split("-")[0] and r["lag_mean"] is not None for r in rows)
    # no harness call failed: the gateway answered everything, no session failed
    assert _one(store, "SELECT count(*) AS n FROM scores WHERE status = 'failed'")["n"] == 0
    # exactly once: no sample twice, and each step's samples are all there
    dup = query(store, "SELECT sample_id FROM ledger GROUP BY 1 HAVING count(*) > 1")
    assert dup.num_rows == 0
    per_step = query(
        store, "SELECT l.step, count(*) AS n FROM ledger l GROUP BY 1 ORDER BY 1"
    ).to_pylist()
    assert [r["n"] for r in per_step] == [r["n_samples"] for r in rows]
    missing = _one(
        store,
        "SELECT count(*) AS n FROM ledger l ANTI JOIN samples s USING (run_id, sample_id)",
    )["n"]
    assert missing == 0
    assert _one(store, "SELECT count(*) AS n FROM ledger WHERE lag_max IS NULL")["n"] == 0
    cells = query(store, "SELECT * FROM cells ORDER BY t").to_pylist()
    decided = [c for c in cells if c["event"] == "decide"]
    assert all(c["reason"] for c in decided)
    report = store.read_bytes(f"runs/{summary['run_id']}/roles.png")
    assert report.startswith(b"\x89PNG")
    if mode == "colocate":
        assert summary["switches"] >= 2 * 3 * (steps - 1)  # all cells out and back each step
        assert all(r["n_members"] == 3 for r in rows) and summary["lag_max"] == 0
    if mode == "async":
        assert summary["switches"] == 0 and summary["lag_max"] <= 1
    if mode.startswith(
        "elastic"
    ):  # joins and leaves of the DP group: tests/infra/cells/test_ledger_dp.py
        assert summary["switches"] > 0 and summary["lag_max"] <= 1
    if mode == "elastic-fsdp":
        # sharded over a changing member set: some step had more than one member, and
        # each committed version's sharded state is in the store beside its weights
        assert max(r["n_members"] for r in rows) >= 2
        assert store.exists(f"checkpoints/{summary['run_id']}/v{steps}/sharded")
