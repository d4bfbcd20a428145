"""Explicit Arrow schemas of every dataset in the store.

Each dataset is a directory of append-only Parquet segments; the DuckDB views in
storage/sql.py read them by these names. Column meanings are documented here and
in README.md ("SQL views").
"""

from __future__ import annotations

import pyarrow as pa

_ids = pa.list_(pa.int32())

TITO_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("session_id", pa.string()),
        ("request_id", pa.string()),
        ("seq_no", pa.int32()),
        ("parent_request_id", pa.string()),  # null for a session's first call
        ("prefix_len", pa.int32()),  # tokens shared with parent's input + output
        ("new_input_ids", _ids),  # input suffix after prefix_len (not trainable)
        ("output_ids", _ids),  # policy tokens as generated
        ("output_logprobs", pa.list_(pa.float32())),
        ("weight_version", pa.int64()),
        ("cell_id", pa.string()),
        ("finish_reason", pa.string()),
        ("cached_tokens", pa.int32()),
        ("t_start", pa.float64()),
        ("t_end", pa.float64()),
        ("endpoint", pa.string()),  # chat | completions | generate | responses
        # the request as the harness sent it, JSON (chat: the messages it added since the call
        # it extends, and tools; responses: input, instructions, tools, previous_response_id);
        # null for completions and /generate (their input ids are the request) and in
        # segments written before the column existed
        ("request_json", pa.string()),
        # responses only: the Response object the call answered (GET /v1/responses/{id})
        ("response_json", pa.string()),
    ]
)

# One row per tree node (a segment of a compressed token trie).
NODES_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("session_id", pa.string()),
        ("node_id", pa.int32()),
        ("parent_id", pa.int32()),  # -1 for the root's children
        ("start", pa.int32()),  # token depth of the segment's first token
        ("length", pa.int32()),
        ("depth", pa.int32()),  # node depth in the tree (root children = 1)
        ("provenance", pa.string()),  # policy | tool | env | harness
        ("policy_version", pa.int64()),  # -1 when not policy tokens
        ("request_ids", pa.list_(pa.string())),  # calls whose context passes through
        ("n_children", pa.int32()),
        ("score", pa.float64()),  # sum of sub-task scores earned here, null if none
    ]
)

SCORES_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("session_id", pa.string()),
        ("subtask_id", pa.string()),
        ("score", pa.float64()),  # in [0, 1]
        ("weight", pa.float64()),
        ("at_request_id", pa.string()),  # the call after which it was earned
        ("source", pa.string()),  # harness | env | evaluator
        ("status", pa.string()),  # finished | failed | timeout | unfinished
        ("reason", pa.string()),
    ]
)

ROLLOUTS_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("session_id", pa.string()),
        ("group_id", pa.string()),
        ("step", pa.int32()),  # training step the rollout was collected for
        ("task_id", pa.string()),
        # finished | failed | timeout | lost (its task died with its cell) | unfinished (in
        # flight when the run ended or was killed: flows/unfinished.py); the last two have
        # no reward and are never trained on
        ("status", pa.string()),
        ("reward", pa.float64()),  # declared aggregation of sub-task scores
        ("n_calls", pa.int32()),
        ("n_tokens_unique", pa.int64()),
        ("n_tokens_flat", pa.int64()),  # sum of every call's full context + output
        ("reason", pa.string()),
        ("parent_session_id", pa.string()),  # the session that spawned it (sub-agents)
    ]
)

SAMPLES_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("sample_id", pa.string()),
        ("session_id", pa.string()),
        ("group_id", pa.string()),
        ("step", pa.int32()),  # rollout step it came from
        ("token_ids", _ids),  # packed tree, tokens in topological order
        ("parent_idx", _ids),  # per token: index of the previous token, -1 at a root
        ("positions", _ids),  # per token: depth in its path
        ("weight_pos", pa.list_(pa.float32())),  # loss weight, positive advantage part
        ("weight_neg", pa.list_(pa.float32())),  # loss weight, negative advantage part
        ("behaviour_logprobs", pa.list_(pa.float32())),
        ("versions", pa.list_(pa.int64())),  # policy version per token, -1 non-policy
        ("n_tokens", pa.int32()),
        ("n_trainable", pa.int32()),
        ("n_flat_tokens", pa.int64()),  # tokens the same paths cost trained flat
        ("reward", pa.float64()),
        (
            "n_flat_trainable",
            pa.int64(),
        ),  # trainable tokens summed over branches: the loss normaliser
        ("counts", pa.list_(pa.int32())),  # per token: branches that train it (KL/entropy)
        ("version_min", pa.int64()),  # oldest policy version among its trainable tokens
        ("version_max", pa.int64()),  # newest; -1 when it has no trainable token
    ]
)

STEPS_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("step", pa.int32()),
        ("weight_version", pa.int64()),  # version produced by this step
        ("loss", pa.float64()),
        ("tokens", pa.int64()),  # tokens in the forward pass
        ("trainable_tokens", pa.int64()),
        ("reward", pa.float64()),  # mean reward of the samples trained
        ("n_samples", pa.int32()),
        ("grad_norm", pa.float64()),
        ("mean_staleness", pa.float64()),
        ("cells", pa.list_(pa.string())),  # the data-parallel members, in rank order
        ("t_start", pa.float64()),
        ("t_end", pa.float64()),
        ("checkpoint", pa.string()),
        ("lag_mean", pa.float64()),  # policy lag of the step's trained tokens, token-weighted
        ("lag_max", pa.int64()),  # (versions between generation and the step's start weights)
        ("n_members", pa.int32()),  # DP members
        ("generation", pa.int32()),  # DP group generation (changes when members change)
        ("mode", pa.string()),  # colocate | async | elastic
        ("dropped_tokens", pa.int64()),  # trainable tokens over the lag bound, not trained
    ]
)

LEDGER_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("step", pa.int32()),
        ("sample_id", pa.string()),
        ("weight_version", pa.int64()),
        ("t", pa.float64()),
        ("lag_mean", pa.float64()),  # this sample's policy lag when trained, token-weighted
        ("lag_max", pa.int64()),
    ]
)

CELLS_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("cell_id", pa.string()),
        ("event", pa.string()),  # join | decide | role | load_weights | step | leave
        ("role", pa.string()),  # rollout | train | draining | loading
        ("weight_version", pa.int64()),
        ("t", pa.float64()),
        ("detail", pa.string()),
        ("reason", pa.string()),  # why the scheduler decided it (its inputs, with numbers)
        # what the action cost, measured by the executor (null where it has no such part):
        # a `role`/`load_weights` row from its decision, a `step_done` row from the step's start
        ("seconds", pa.float64()),  # the whole action, to this row
        ("wait_s", pa.float64()),  # decision to the action's start (pin, cell lock, pool)
        ("drain_s", pa.float64()),  # the gateway's withdrawal (calls to their boundary, KV)
        ("park_s", pa.float64()),  # the engine parked (KV freed)
        ("start_s", pa.float64()),  # the engine started (a cell that had none)
        ("load_s", pa.float64()),  # weights loaded into the engine (fetch and swap)
        # a `step_done` row's parts, this member's own (tasks/train_step.py member_step)
        ("dispatch_s", pa.float64()),  # the step's start to this member's (submit, schedule)
        ("form_s", pa.float64()),  # its DP group formed (0: the generation was kept)
        ("sync_s", pa.float64()),  # its state brought to the step's version
        ("train_s", pa.float64()),  # samples read, forward, backward, reduce (paced included)
        ("commit_s", pa.float64()),  # rank 0: checkpoint staged, step committed
    ]
)

# One row per held-out task per evaluated policy version (tasks/evaluate.py): greedy
# sessions on task seeds training never draws (tasks/env/heldout.py); never trained on.
EVALS_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("version", pa.int64()),  # policy version evaluated (0 = the initial weights)
        ("step", pa.int32()),  # optimizer steps of this run done when it was evaluated
        ("seed", pa.int64()),  # the held-out task seed
        ("task_id", pa.string()),
        ("session_id", pa.string()),  # its calls are in `tito` (never in `samples`)
        ("cell_id", pa.string()),  # the rollout cell that served it
        ("status", pa.string()),  # finished | failed | timeout
        ("reason", pa.string()),
        ("reward", pa.float64()),  # the run's reward aggregation of the sub-task scores
        ("n_calls", pa.int32()),
        ("subtask_ids", pa.list_(pa.string())),
        ("subtask_scores", pa.list_(pa.float64())),  # aligned with subtask_ids, in [0, 1]
        ("t", pa.float64()),  # when the session ended (unix seconds)
        ("seconds", pa.float64()),  # the session's wall time
    ]
)

SCHEMAS: dict[str, pa.Schema] = {
    "tito": TITO_SCHEMA,
    "nodes": NODES_SCHEMA,
    "scores": SCORES_SCHEMA,
    "rollouts": ROLLOUTS_SCHEMA,
    "samples": SAMPLES_SCHEMA,
    "steps": STEPS_SCHEMA,
    "ledger": LEDGER_SCHEMA,
    "cells": CELLS_SCHEMA,
    "evals": EVALS_SCHEMA,
}
