"""Training on the sessions a ``gyre serve`` recorded: offline RL from the store.

A user's own harness talks to ``gyre serve`` (every call lands in ``tito`` under the serve's
run id, ``serve`` by default) and scores each session through the documented call::

    POST {gateway}/gyre/scores   Authorization: Bearer <the session's API key>
    {"subtask_id": "answer", "score": 1.0}          (or {"scores": [{...}, ...]})

``gyre run --from-served RUN_ID`` then trains on them, without Prefect or cells: the
scored sessions that no earlier pass used become one step's group(s) (a session's
``group_id`` from ``gyre session new --group``/``POST /gyre/sessions``, else one group of
all of them), their rewards the declared aggregation of their scores, GRPO advantages,
the same processing (trees, ``rollouts``, ``samples``) and the same committed step
(checkpoint ``v{N+1}``, ``ledger``, ``steps``) as a ``gyre run``. Sessions with the same
reward teach nothing (zero advantage) and are skipped. Run it again when more sessions are
scored; serve the new weights with ``gyre serve --model <store>/checkpoints/RUN_ID/vN``.

``gyre serve`` publishes the model it serves as the run's ``v0`` (the start of this chain,
and the tokenizer of ``calls``/``transcripts``/``gyre export``). The policy lag bound does
not apply here: the sessions were sampled by whatever the server served, and every trained
token's lag is in ``ledger``/``steps`` as usual.
"""

from __future__ import annotations

from typing import Any

from flows.config import RunConfig
from storage.checkpoints import latest_version
from storage.lease import Lease
from storage.paths import spool_dir
from storage.store import Store
from tasks.handles import SessionHandle


class ServedError(RuntimeError):
    """Nothing to train on, or no model to start from; the message says what to do."""


def pending_sessions(store: Store, run_id: str) -> list[SessionHandle]:
    """Sessions of ``run_id`` in ``tito`` with at least one score and no ``rollouts`` row
    yet (no earlier pass used them), each with its group from the serve's session journal."""

    def ids(dataset: str) -> set[str]:
        t = store.read(dataset)
        if not t.num_rows:
            return set()
        return {s for r, s in zip(t["run_id"].to_pylist(), t["session_id"].to_pylist(),
                                  strict=True) if r == run_id}  # fmt: skip

    scored = ids("tito") & ids("scores")
    todo = sorted(scored - ids("rollouts"))
    groups = _journal_groups(store, run_id)
    return [
        SessionHandle(sid, groups.get(sid, ""), sid, 0, "finished", {}, "served") for sid in todo
    ]


def _journal_groups(store: Store, run_id: str) -> dict[str, str]:
    """session id -> group id from the serve's session journal, where this machine has it."""
    from infra.gateway.sessions import SessionTable

    path = spool_dir(store.url, run_id) / "sessions.jsonl"
    if not path.exists():
        return {}
    return {s.session_id: s.group_id for s in SessionTable(str(path)).all()}


def next_step(store: Store, run_id: str) -> int:
    t = store.read("steps")
    steps = [s for r, s in zip(t["run_id"].to_pylist(), t["step"].to_pylist(), strict=True)
             if r == run_id] if t.num_rows else []  # fmt: skip
    return max(steps) + 1 if steps else 0


_NOTHING_TO_LEARN = (
    "the {n} sessions have equal rewards within each group: no advantage to learn from "
    "(GRPO); score sessions that differ (or post another sub-task's score for these), then "
    "run again"
)


def _learnable(store: Store, run_id: str, sessions: list[SessionHandle], cfg: RunConfig) -> bool:
    """Whether some group of ``sessions`` has an advantage to learn from: their rewards (the
    aggregation of their scores, as processing computes them) differ within it. Asked
    before processing writes ``rollouts``, so that a pass with nothing to learn uses none
    of the sessions up (they stay pending until their scores differ)."""
    from tasks.trajectory.sampler import zero_variance_groups
    from tasks.trajectory.scoring import Score, score_rollout

    t = cfg.train
    sids = {s.session_id for s in sessions}
    scores = [
        Score(**{k: r[k] for k in Score.__dataclass_fields__})
        for r in store.read("scores").to_pylist()
        if r["run_id"] == run_id and r["session_id"] in sids
    ]
    rewards = {
        s.session_id: score_rollout(
            run_id, s.session_id, scores, declared=s.subtasks or None, status=s.status,
            reason=s.reason, aggregation=t.reward_aggregation,
        ).reward
        for s in sessions
    }  # fmt: skip
    groups = {s.session_id: s.group_id for s in sessions}
    flat = zero_variance_groups(
        rewards, groups, advantage=t.advantage, scores=scores, normalize_std=t.normalize_std
    )
    return len(set(flat)) < len(set(groups.values()))


def train_served(store: Store, run_id: str, cfg: RunConfig, say=print) -> dict[str, Any]:
    """One optimizer step on the scored sessions of ``run_id`` not trained on yet (see the
    module doc); the step's figures."""
    from tasks.process import process_sessions
    from tasks.train_step import train_on_samples

    with Lease(store, run_id, "gyre run --from-served"):  # a running `gyre serve` refuses it
        version = latest_version(store, run_id)
        if version is None:
            raise ServedError(
                f"run {run_id!r} has no checkpoint in {store.url}: serve it once with this "
                "gyre (`gyre serve` publishes the served model as v0), or publish one"
            )
        sessions = pending_sessions(store, run_id)
        if not sessions:
            raise ServedError(
                f"no scored session of run {run_id!r} waits for training in {store.url}: "
                "score sessions with POST /gyre/scores (README: serve, score, train), and "
                "stop `gyre serve` so that its last calls are flushed"
            )
        step = next_step(store, run_id)
        t = cfg.train
        if not _learnable(store, run_id, sessions, cfg):  # before anything is written
            raise ServedError(_NOTHING_TO_LEARN.format(n=len(sessions)))
        done = process_sessions(
            store, run_id, step, sessions, current_version=version,
            reward_aggregation=t.reward_aggregation, advantage=t.advantage,
            max_staleness=None, stale_policy=t.stale_policy, normalize_std=t.normalize_std,
        )  # fmt: skip
        say(
            f"{len(sessions)} scored sessions ({done.n_calls} calls), mean reward "
            f"{done.reward_mean:.3f}: {done.n_samples} samples"
        )
        if not done.n_samples:
            raise ServedError(_NOTHING_TO_LEARN.format(n=len(sessions)))
        trained = train_on_samples(store, run_id, step, done.samples_segment, t, cell_id="local")
    return {
        "run_id": run_id,
        "store": store.url,
        "step": step,
        "weight_version": trained.weight_version,
        "sessions": len(sessions),
        "samples": done.n_samples,
        "loss": trained.metrics.get("train/loss"),
        "checkpoint": trained.checkpoint,
    }
