"""Sessions a run leaves in flight get a ``rollouts`` row with status ``unfinished``.

A run ends (its steps done, Ctrl-C, a failure) with rollouts still going: the sessions of
groups not yet processed, their calls in ``tito``; a killed run leaves the same. Without a
``rollouts`` row SQL could not tell them from sessions still running (or from a ``gyre
serve`` run's, which ``gyre export`` and ``--from-served`` read as the sessions without
one). At the end of every run (`mark_unfinished`, from flows/rl_run.py) each session of the
run's gateway journal that has no row gets one: ``status`` ``unfinished``, no ``reward``
(never trained on: ``avg(reward)`` and the exports skip it, as for ``lost``), its calls and
tokens from ``tito``, and a ``reason`` that says whether the session itself had ended (its
scores were written) or the run ended first. A killed run's sessions are marked at the end
of the run that resumes it (the same journal). Held-out evaluations' sessions have their
rows in ``evals`` instead and are left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage.sql import query
from storage.store import Store

log = logging.getLogger(__name__)

IN_FLIGHT = "the run ended (or was stopped or killed) before the session did; never trained on"
UNPROCESSED = (
    "the session ended ({status}) but the run ended before its group was processed; "
    "never trained on"
)


@dataclass(frozen=True)
class Minted:
    """A session the run's gateway handed out (a line of its journal)."""

    session_id: str
    group_id: str
    meta: Mapping[str, Any]


@dataclass(frozen=True)
class Calls:
    """What ``tito`` holds of one session."""

    n_calls: int
    n_tokens_unique: int  # new input + output of every call
    n_tokens_flat: int  # every call's full context + output


def unfinished_rows(
    run_id: str,
    minted: Iterable[Minted],
    known: set[str],
    calls: Mapping[str, Calls],
    ended: Mapping[str, str],
) -> list[dict[str, Any]]:
    """The ``rollouts`` rows of the sessions in ``minted`` that have none (``known``),
    held-out evaluations' excepted; ``calls`` per session from ``tito``, ``ended``: the
    status of the sessions whose scores were written (their rollout task ended)."""
    rows = []
    for s in minted:
        if s.session_id in known or s.meta.get("eval"):
            continue
        c = calls.get(s.session_id, Calls(0, 0, 0))
        status = ended.get(s.session_id)
        rows.append(
            {
                "run_id": run_id,
                "session_id": s.session_id,
                "group_id": s.group_id,
                "step": s.meta.get("step"),
                "task_id": s.meta.get("task_id"),
                "status": "unfinished",
                "reward": None,
                "n_calls": c.n_calls,
                "n_tokens_unique": c.n_tokens_unique,
                "n_tokens_flat": c.n_tokens_flat,
                "reason": IN_FLIGHT if status is None else UNPROCESSED.format(status=status),
                "parent_session_id": None,
            }
        )
    return rows


def journal_sessions(journal: Path) -> list[Minted]:
    """The sessions of a gateway's session journal (none if it has none)."""
    from infra.gateway.sessions import SessionTable

    if not journal.exists():
        return []
    return [Minted(s.session_id, s.group_id, s.meta) for s in SessionTable(str(journal)).all()]


def mark_unfinished(store: Store, run_id: str, journal: Path) -> int:
    """Append the ``unfinished`` rows of ``run_id``'s sessions in ``journal`` that have no
    ``rollouts`` row; how many. Call it once the gateway stopped (its calls are in
    ``tito``); a second call writes nothing."""
    minted = journal_sessions(journal)
    if not minted:
        return 0
    rid = run_id.replace("'", "''")
    known = {
        r["session_id"]
        for r in query(
            store, f"SELECT DISTINCT session_id FROM rollouts WHERE run_id = '{rid}'"
        ).to_pylist()
    }
    if all(s.session_id in known or s.meta.get("eval") for s in minted):
        return 0
    calls = {
        r["session_id"]: Calls(int(r["n"]), int(r["uniq"]), int(r["flat"]))
        for r in query(
            store,
            "SELECT session_id, count(*) AS n, "
            "sum(len(new_input_ids) + len(output_ids)) AS uniq, "
            "sum(prefix_len + len(new_input_ids) + len(output_ids)) AS flat "
            f"FROM tito WHERE run_id = '{rid}' GROUP BY session_id",
        ).to_pylist()
    }
    ended = {
        r["session_id"]: r["status"]
        for r in query(
            store,
            f"SELECT session_id, min(status) AS status FROM scores WHERE run_id = '{rid}' "
            "GROUP BY session_id",
        ).to_pylist()
    }
    rows = unfinished_rows(run_id, minted, known, calls, ended)
    if rows:
        store.append("rollouts", rows)
        log.info("run %s: %d session(s) left in flight marked unfinished", run_id, len(rows))
    return len(rows)
