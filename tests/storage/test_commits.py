"""Fast: a step's commit (storage/commits.py) without training: staged files are invisible,
the marker commits checkpoint + rows, a crash between the marker and the rows is completed
once by ``roll_forward``, and a resumed run continues after the newest committed step."""

from __future__ import annotations

import os
from pathlib import Path

from storage.checkpoints import (
    commit_checkpoint,
    fetch_checkpoint,
    latest_version,
    publish_checkpoint,
    stage_checkpoint,
)
from storage.commits import commit_step_record, last_committed, roll_forward, rows_by_step
from storage.store import Store
from tests.s3 import moto_s3

RUN = "c"


def _rows(step: int, version: int, samples: list[str]):
    ledger = [
        {"run_id": RUN, "step": step, "sample_id": s, "weight_version": version, "t": 0.0}
        for s in samples
    ]
    steps = {"run_id": RUN, "step": step, "weight_version": version, "n_samples": len(samples)}
    return ledger, steps


def _ledger(store: Store) -> list[tuple[int, str]]:
    t = store.read("ledger").to_pylist()
    return sorted((r["step"], r["sample_id"]) for r in t if r["run_id"] == RUN)


def test_commit_then_crash_before_rows_then_roll_forward(tmp_path):
    store = Store(str(tmp_path / "s"))
    src = tmp_path / "ck"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"w")
    publish_checkpoint(store, RUN, str(src), 0)
    assert last_committed(store, RUN) is None  # v0 is a model, not a step

    # step 0 -> v1, committed and projected
    stage_checkpoint(store, RUN, str(src), 1)
    assert latest_version(store, RUN) == 0  # staged: invisible
    commit_step_record(store, RUN, 0, 1, *_rows(0, 1, ["a", "b"]))
    assert latest_version(store, RUN) == 1
    assert _ledger(store) == [(0, "a"), (0, "b")]
    assert rows_by_step(store, "steps", RUN) == {0: 1}
    assert roll_forward(store, RUN) == []  # nothing to complete

    # step 1 -> v2: the marker is written, then the process dies before the rows
    stage_checkpoint(store, RUN, str(src), 2)
    ledger, steps = _rows(1, 2, ["c"])
    commit_checkpoint(store, RUN, 2, {"run_id": RUN, "step": 1, "ledger": ledger, "steps": steps})
    assert last_committed(store, RUN) == (2, 2)  # committed: the next step is 2
    assert rows_by_step(store, "steps", RUN) == {0: 1}
    assert roll_forward(store, RUN) == [1]
    assert roll_forward(store, RUN) == []  # once
    assert _ledger(store) == [(0, "a"), (0, "b"), (1, "c")]
    assert rows_by_step(store, "steps", RUN) == {0: 1, 1: 2}
    assert rows_by_step(store, "ledger", RUN) == {0: 1, 1: 2}

    # step 2 staged but never committed: the run resumes after step 1, at v2
    stage_checkpoint(store, RUN, str(src), 3)
    assert latest_version(store, RUN) == 2
    assert last_committed(store, RUN) == (2, 2)
    assert roll_forward(store, RUN) == []


def _old_state_dropped(store: Store, src: Path) -> None:
    cache = str(src.parent / "cache")
    (src / "model.safetensors").write_bytes(b"w")
    publish_checkpoint(store, RUN, str(src), 0)
    (src / "optimizer.pt").write_bytes(b"adam")
    for step in range(4):
        stage_checkpoint(store, RUN, str(src), step + 1)
        commit_step_record(store, RUN, step, step + 1, *_rows(step, step + 1, [f"x{step}"]))

    def files(v: int) -> list[str]:
        return store.listdir(f"checkpoints/{RUN}/v{v}")

    assert [("optimizer.pt" in files(v)) for v in range(5)] == [False, False, False, True, True]
    assert all("model.safetensors" in files(v) for v in range(5))
    # the newest version restores with its state; an old one still serves its weights
    newest = fetch_checkpoint(store, RUN, 4, cache, with_optimizer=True)
    assert (Path(newest) / "optimizer.pt").read_bytes() == b"adam"
    assert "model.safetensors" in os.listdir(fetch_checkpoint(store, RUN, 1, cache))


def test_old_versions_lose_their_optimizer_state_not_their_weights(tmp_path):
    """A committed step keeps AdamW state (twice the weights) only in the newest two
    versions: a run of N steps no longer writes N copies of it. The weights of every
    version stay (evaluation, serving, export)."""
    src = tmp_path / "ck"
    src.mkdir()
    _old_state_dropped(Store(str(tmp_path / "s")), src)


def test_old_optimizer_state_dropped_on_s3(tmp_path, free_port):
    src = tmp_path / "ck"
    src.mkdir()
    with moto_s3(free_port(), ("ckpts",)):
        _old_state_dropped(Store("s3://ckpts/store", retry_s=10), src)
