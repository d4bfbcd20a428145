"""A training step's commit: its checkpoint, its ``ledger`` rows and its ``steps`` row as
one atomic act, so that after a crash no sample is trained twice and none is lost.

1. stage: the new version's files go to ``checkpoints/{run_id}/v{N}/``, invisible (no
   marker yet); a retry of the step restages the same version over them;
2. commit: one atomic write of the version's ``COMPLETE`` marker, whose body is the commit
   record: run, step, version, the step's ledger rows and its steps row (JSON);
3. project: the record's rows are appended to ``ledger`` and ``steps``.

Readers trust only committed steps: ``latest_version`` sees a version only once its marker
exists, and ledger/steps rows are written only after it. A crash before 2 leaves nothing
visible (the step is retried from the same start version); a crash between 2 and 3 leaves a
committed step whose rows are missing, and ``roll_forward`` (run by whoever picks the run
up: a step retry, ``gyre run --resume``) writes them. Projection is idempotent per dataset:
a step's rows in one dataset are one segment, so they are all there or none is.
"""

from __future__ import annotations

import logging
from typing import Any

import pyarrow.compute as pc

from storage.checkpoints import commit_checkpoint, drop_optimizer_state, read_commit, versions
from storage.store import Store

log = logging.getLogger(__name__)

_DATASETS = ("ledger", "steps")


def commit_step_record(
    store: Store,
    run_id: str,
    step: int,
    version: int,
    ledger_rows: list[dict[str, Any]],
    steps_row: dict[str, Any],
) -> str:
    """Commit a staged checkpoint as step ``step``'s result, then project its rows.

    Returns the checkpoint's store URL. Call ``stage_checkpoint`` for ``version`` first.
    """
    record = {"run_id": run_id, "step": step, "ledger": ledger_rows, "steps": steps_row}
    url = commit_checkpoint(store, run_id, version, record)
    # the step is committed now; the rows below are its projection (roll_forward redoes it)
    store.append("ledger", ledger_rows)
    store.append("steps", [steps_row])
    # the version before this one keeps its state too: a step retried from it after a
    # crash between its own stage and commit finds what it needs
    drop_optimizer_state(store, run_id, below=version - 1)
    return url


def committed_steps(store: Store, run_id: str) -> list[dict[str, Any]]:
    """The commit records of the run's committed steps, by version (oldest first)."""
    out = []
    for v in versions(store, run_id):
        rec = read_commit(store, run_id, v)
        if rec is not None and "step" in rec:
            out.append(rec)
    return out


def rows_by_step(store: Store, dataset: str, run_id: str) -> dict[int, int]:
    """Steps of ``run_id`` that have rows in ``dataset`` (``ledger`` or ``steps``), with
    the weight version each produced."""
    table = store.read(dataset)
    if table.num_rows == 0:
        return {}
    mine = table.filter(pc.equal(table["run_id"], run_id))
    steps, vs = mine["step"].to_pylist(), mine["weight_version"].to_pylist()
    return {int(s): int(v) for s, v in zip(steps, vs, strict=True)}


def roll_forward(store: Store, run_id: str) -> list[int]:
    """Write the ledger/steps rows of committed steps that a crash left without them.

    Returns the steps completed. Only versions newer than the newest ``steps`` row are
    read (rows are projected ledger first, then steps, step after step), so a healthy run
    pays one listing. Safe to call any number of times, but not while a step may still be
    projecting its own rows (call it when no step runs, or before a step's own commit).
    """
    have = {ds: rows_by_step(store, ds, run_id) for ds in _DATASETS}
    top = max(have["steps"].values(), default=-1)
    done = []
    for v in versions(store, run_id):
        if v <= top:
            continue
        rec = read_commit(store, run_id, v)
        if rec is None or "step" not in rec:
            continue
        step = int(rec["step"])
        wrote = False
        if step not in have["ledger"] and rec["ledger"]:
            store.append("ledger", rec["ledger"])
            wrote = True
        if step not in have["steps"]:
            store.append("steps", [rec["steps"]])
            wrote = True
        if wrote:
            log.warning("step %d of %s was committed without its rows: written now", step, run_id)
            done.append(step)
    return done


def last_committed(store: Store, run_id: str) -> tuple[int, int] | None:
    """``(next step number, newest committed version)`` of a run, or None if it has no
    committed step; what a resumed run continues from."""
    records = committed_steps(store, run_id)
    if not records:
        return None
    last = max(records, key=lambda r: int(r["version"]))
    return int(last["step"]) + 1, int(last["version"])
