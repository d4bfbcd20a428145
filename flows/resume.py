"""Continuing a run: ``gyre run --resume RUN_ID`` and the nightly deployment.

A run leaves what it needs to continue in the store: its resolved settings
(``runs/{run_id}/config.json``, written when it starts) and its committed steps (each
checkpoint's marker is the step's commit record, storage/commits.py). A resumed run:

- takes the stored settings, then any ``key=value`` overrides (``train.steps=16`` to train
  further: ``train.steps`` counts the run's steps in total);
- completes the rows of a step whose commit a crash interrupted (``roll_forward``), then
  starts from the newest committed version with the next step number, and with new rollout
  groups (new tasks: group numbers continue past every group the run started);
- replays the gateway's write-ahead log left by the killed process (the spool is keyed by
  store and run id), so answered calls that never reached the store get there, once.

Steps that had not committed are trained again from their start version; rollouts that
finished but were not trained are not (their calls stay in ``tito``).

Pure module apart from the store: no prefect, no distributed.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

import pyarrow.compute as pc

from flows.config import ConfigError, RunConfig, load_config
from storage.checkpoints import latest_version
from storage.commits import last_committed, roll_forward
from storage.paths import RunIdError, check_run_id
from storage.store import Store, StoreError

_GROUP = re.compile(r"^g(\d+)$")


def new_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def config_relpath(run_id: str) -> str:
    return f"runs/{run_id}/config.json"


def save_config(store: Store, cfg: RunConfig) -> str:
    """Store a run's resolved settings (what ``--resume`` continues with)."""
    return store.write_bytes(config_relpath(cfg.run_id), cfg.model_dump_json(indent=2).encode())


def stored_config(store: Store, run_id: str) -> dict[str, Any] | None:
    try:
        return json.loads(store.read_bytes(config_relpath(run_id)))
    except FileNotFoundError:
        return None


def resume_config(
    run_id: str, store: str, overrides: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """The settings a resumed run continues with: its stored ones, then ``overrides``.
    Raises `ConfigError` (naming the fix) when the store holds no such run."""
    try:
        check_run_id(run_id)  # before it names any path
    except RunIdError as exc:
        raise ConfigError([f"--resume: {exc}"]) from None
    try:
        st = Store(store, create=False)
    except StoreError as exc:  # a resumed run continues one already in the store
        raise ConfigError(
            [f"--resume {run_id}: {exc}; a resumed run continues in the store it started on"]
        ) from None
    base = stored_config(st, run_id)
    if base is None:
        known = sorted(p for p in st.listdir("runs"))
        hint = f"runs in {st.url}: {', '.join(known[-5:])}" if known else f"no runs in {st.url}"
        raise ConfigError(
            [f"--resume {run_id}: the store has no run {run_id!r} to continue ({hint})"]
        )
    base["run_id"] = run_id
    return load_config(base=base, overrides=overrides, store=store)


@dataclass(frozen=True)
class ResumePoint:
    """Where a run continues: its next step number, the version it starts from (None: no
    checkpoint yet, a new run) and the first rollout group number it may use."""

    next_step: int
    version: int | None
    first_group: int

    @property
    def fresh(self) -> bool:
        return self.version is None


def resume_point(store: Store, run_id: str, started_groups: list[str] = ()) -> ResumePoint:
    """What the store says about ``run_id`` (after completing any interrupted commit).

    ``started_groups``: group ids of sessions the run's gateway knows (its journal), so that
    groups started but never finished are not numbered again either.
    """
    roll_forward(store, run_id)
    last = last_committed(store, run_id)
    groups = list(started_groups)
    rollouts = store.read("rollouts")
    if rollouts.num_rows:
        mine = rollouts.filter(pc.equal(rollouts["run_id"], run_id))
        groups += mine["group_id"].to_pylist()
    indices = [int(m.group(1)) for g in groups if g and (m := _GROUP.match(g))]
    return ResumePoint(
        next_step=last[0] if last else 0,
        version=latest_version(store, run_id),
        first_group=max(indices) + 1 if indices else 0,
    )
