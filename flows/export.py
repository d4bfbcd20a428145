"""``gyre export``: a run's trajectories as a flat RL dataset other trainers can use.

gyre trains packed trees; most RL libraries train flat sequences. This writes one
row per branch of every session's trajectory tree (a root-to-leaf path: one model
call's full context plus its output), with the loss mask and the per-branch advantage
gyre's sampler computes, as Parquet that Hugging Face ``datasets`` loads directly::

    gyre export RUN_ID --store ./gyre-data --out run.parquet
    datasets.load_dataset("parquet", data_files="run.parquet")["train"]

Columns (the ``*_ids``/``*_mask``/``*_logprobs`` lists are aligned token by token):

| column | meaning |
| --- | --- |
| ``run_id, session_id, group_id, step, request_id`` | where the branch comes from (``request_id`` = the call that ends it) |
| ``prompt_ids`` | tokens before the branch's first trainable token (system/user text) |
| ``response_ids`` | the rest of the branch, up to its last trainable token |
| ``response_mask`` | 1 where a token is the policy's output (trainable), 0 for tool/env/template text |
| ``behaviour_logprobs`` | logprob the generating policy gave each response token (0 where masked) |
| ``weight_versions`` | policy version that generated each response token (-1 where masked) |
| ``reward`` | the rollout's reward (declared aggregation of its sub-task scores) |
| ``advantage`` | the branch's advantage (``--advantage``: grpo = group-normalised reward) |
| ``prompt_text``, ``response_text`` | the two token lists decoded with the run's own tokenizer (its v0 checkpoint), special tokens kept; null for a run without checkpoints |
| ``request_json`` | the request of the call that ends the branch as the harness sent it, JSON: a chat call's whole ``messages`` and its ``tools``; a Responses call's ``input``, ``instructions``, ``tools``, ``previous_response_id``; null where the call has none (Completions, ``/generate``) |

A ``gyre serve`` run exports too: its sessions that no ``gyre run --from-served`` pass used
yet come out with ``step`` -1, one group per ``group_id``, their reward the weighted mean of
the scores posted for them (0 when none was).

A branch shares its prefix with its siblings; trained flat, the shared tokens are
trained once per branch (what gyre's tree packing avoids).
"""

from __future__ import annotations

import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from storage.checkpoints import versions
from storage.store import Store
from storage.tito import whole_requests
from storage.tito_log import table_to_records
from tasks.trajectory.sampler import build_samples
from tasks.trajectory.scoring import Score, score_rollout
from tasks.trajectory.tree import build_trees

FORMATS = ("parquet",)

EXPORT_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("session_id", pa.string()),
        ("group_id", pa.string()),
        ("step", pa.int32()),
        ("request_id", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("response_mask", pa.list_(pa.int8())),
        ("behaviour_logprobs", pa.list_(pa.float32())),
        ("weight_versions", pa.list_(pa.int64())),
        ("reward", pa.float64()),
        ("advantage", pa.float64()),
        ("prompt_text", pa.string()),
        ("response_text", pa.string()),
        ("request_json", pa.string()),
    ]
)


class ExportError(RuntimeError):
    """The run cannot be exported; the message says why."""


def branch_rows(store: Store, run_id: str, *, advantage: str = "grpo") -> list[dict]:
    """One row per branch of every session of ``run_id`` (see the module docstring)."""
    tito = store.read("tito")
    records = [r for r in table_to_records(tito) if r.run_id == run_id]
    scores = [
        Score(**{k: s[k] for k in Score.__dataclass_fields__})
        for s in store.read("scores").to_pylist()
        if s["run_id"] == run_id
    ]
    stored = [r for r in store.read("rollouts").to_pylist() if r["run_id"] == run_id]
    # lost and unfinished sessions have no reward (never trained on): no branches
    rollouts = [r for r in stored if r["reward"] is not None]
    # held-out evaluations' sessions (in `evals`) are no training data either
    held = [r["session_id"] for r in store.read("evals").to_pylist() if r["run_id"] == run_id]
    rollouts += _served(run_id, records, scores, {r["session_id"] for r in stored} | set(held))
    if not rollouts:
        raise ExportError(f"no rollouts of run {run_id!r} in {store.url}; check the run id")
    parents = {r["session_id"]: r["parent_session_id"] for r in rollouts if r["parent_session_id"]}
    trees = build_trees(records, session_parents=parents)
    rows = []
    for step in sorted({r["step"] for r in rollouts}):
        of_step = [r for r in rollouts if r["step"] == step]
        # a group's advantage baseline is the group's rewards, as in training
        rewards = {r["session_id"]: r["reward"] for r in of_step if not r["parent_session_id"]}
        groups = {r["session_id"]: r["group_id"] for r in of_step}
        step_trees = {sid: trees[sid] for sid in groups if sid in trees}
        samples = build_samples(
            step_trees,
            rewards,
            groups,
            run_id=run_id,
            step=step,
            advantage=advantage,
            scores=scores,
            layout="flat",
            filter_zero_variance=False,  # a dataset keeps every branch; its user decides
        )
        for s in samples:
            rows.append(_row(s))
    requests = whole_requests(records, [r["request_id"] for r in rows])
    for r in rows:
        r["request_json"] = requests[r["request_id"]]
    if rows and versions(store, run_id):  # text needs the run's tokenizer (its v0)
        from storage.transcripts import tokenizer

        tok = tokenizer(store, run_id)
        for r in rows:
            r["prompt_text"] = tok.decode(r["prompt_ids"], skip_special_tokens=False)
            r["response_text"] = tok.decode(r["response_ids"], skip_special_tokens=False)
    return rows


def _served(run_id: str, records, scores: list[Score], known: set[str]) -> list[dict]:
    """Pseudo-rollouts of the sessions with calls but no ``rollouts`` row (a ``gyre serve``
    run's sessions no pass trained on yet): step -1, group by ``group_id`` is unknown here
    (one group), reward the weighted mean of their scores (0 without any)."""
    sids = sorted({r.session_id for r in records} - known)
    return [
        {
            "session_id": sid,
            "group_id": "",
            "step": -1,
            "reward": score_rollout(run_id, sid, scores).reward,
            "parent_session_id": None,
        }
        for sid in sids
    ]


def _row(s) -> dict:
    policy = s.versions >= 0  # the policy's own tokens (template/tool/env text is -1)
    first = int(np.argmax(policy)) if policy.any() else len(s.token_ids)
    w = s.weight_pos + s.weight_neg  # the branch's advantage on each of its policy tokens
    adv = float(w[policy][0]) if policy.any() else 0.0
    resp = slice(first, len(s.token_ids))
    return {
        "run_id": s.run_id,
        "session_id": s.session_id,
        "group_id": s.group_id,
        "step": s.step,
        "request_id": s.sample_id.rsplit("/", 1)[-1],
        "prompt_ids": s.token_ids[:first].tolist(),
        "response_ids": s.token_ids[resp].tolist(),
        "response_mask": policy[resp].astype(np.int8).tolist(),
        "behaviour_logprobs": np.where(policy, s.behaviour_logprobs, 0.0)[resp].tolist(),
        "weight_versions": s.versions[resp].tolist(),
        "reward": s.reward,
        "advantage": adv,
    }


def export_run(
    store: Store, run_id: str, out: str, *, fmt: str = "parquet", advantage: str = "grpo"
) -> int:
    """Write the run's branch rows to ``out``; returns the number of rows."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    _check_out(out)
    rows = branch_rows(store, run_id, advantage=advantage)
    try:
        pq.write_table(pa.Table.from_pylist(rows, schema=EXPORT_SCHEMA), out, compression="zstd")
    except OSError as exc:
        raise ExportError(f"--out {out!r}: cannot write it: {exc}") from exc
    return len(rows)


def _check_out(out: str) -> None:
    """``--out`` names a file that can be written: not a directory, in a directory that
    exists and is writable (checked before the run's rows are read)."""
    import os

    if "://" in out:  # an object-store URL: its filesystem says when writing
        return
    path = os.path.abspath(os.path.expanduser(out))
    if os.path.isdir(path):
        raise ExportError(
            f"--out {out!r} is a directory: name a file, e.g. {out.rstrip('/')}/run.parquet"
        )
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ExportError(f"--out {out!r}: its directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ExportError(f"--out {out!r}: its directory {parent} is not writable")


def main_export(args) -> int:
    from storage.store import StoreError

    try:
        store = Store(args.store, create=False)
        n = export_run(store, args.run_id, args.out, fmt=args.format, advantage=args.advantage)
    except (ExportError, StoreError) as exc:
        print(f"gyre export: {exc}", file=sys.stderr)
        return 2
    print(f"gyre export: {n} branches of run {args.run_id} -> {args.out}")
    return 0
