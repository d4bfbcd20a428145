"""TITO records: token-in / token-out, delta-encoded.

A rollout's raw contexts sum to O(calls x context) tokens; a TITO record stores
only what is new: the tokens it shares with its parent record (the earlier call
of the same session whose input + output shares the longest prefix with this
call's input) are named by ``prefix_len``; the rest of the input is
``new_input_ids``. The full input of any record is rebuilt by walking parents.

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class TitoRecord:
    """One model call, as stored (see storage/schemas.py: TITO_SCHEMA)."""

    run_id: str
    session_id: str
    request_id: str
    seq_no: int
    parent_request_id: str | None
    prefix_len: int
    new_input_ids: Sequence[int]
    output_ids: Sequence[int]
    output_logprobs: Sequence[float]
    weight_version: int
    cell_id: str = ""
    finish_reason: str = "stop"
    cached_tokens: int = 0
    t_start: float = 0.0
    t_end: float = 0.0
    endpoint: str = "generate"
    request_json: str | None = None  # the harness's request, as JSON (see TITO_SCHEMA)
    response_json: str | None = None  # the Response object of a ``responses`` call
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_row(self) -> dict[str, Any]:
        row = asdict(self)
        row.pop("extra")
        row["new_input_ids"] = [int(t) for t in self.new_input_ids]
        row["output_ids"] = [int(t) for t in self.output_ids]
        row["output_logprobs"] = [float(x) for x in self.output_logprobs]
        return row

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> TitoRecord:
        names = cls.__dataclass_fields__.keys() - {"extra"}
        return cls(**{k: row[k] for k in names if k in row})


def common_prefix_len(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """Length of the longest common prefix of two token sequences (vectorised)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def delta_encode(
    full_input: Sequence[int], parent_context: Sequence[int] | None
) -> tuple[int, list[int]]:
    """Split a call's full input into (prefix_len shared with parent context, new suffix).

    ``parent_context`` is the parent's full input followed by its output ids.
    """
    if parent_context is None:
        return 0, [int(t) for t in full_input]
    k = common_prefix_len(full_input, parent_context)
    return k, [int(t) for t in full_input[k:]]


class ReconstructionError(ValueError):
    """A record names a parent that is missing or a prefix longer than the parent context."""


def reconstruct_inputs(records: Iterable[TitoRecord]) -> dict[str, np.ndarray]:
    """Full input ids of every record of one or more sessions, keyed by request id.

    Records may come in any order; parents are resolved by request id.
    Returns int32 arrays.
    """
    by_id = {r.request_id: r for r in records}
    out: dict[str, np.ndarray] = {}

    def context_of(rid: str) -> np.ndarray:
        r = by_id[rid]
        return np.concatenate([full(rid), np.asarray(r.output_ids, dtype=np.int32)])

    def full(rid: str) -> np.ndarray:
        if rid in out:
            return out[rid]
        # iterative walk up to the first resolved ancestor, then back down
        chain = []
        cur: str | None = rid
        while cur is not None and cur not in out:
            if cur not in by_id:
                raise ReconstructionError(f"record {chain[-1]!r} names missing parent {cur!r}")
            chain.append(cur)
            cur = by_id[cur].parent_request_id
        for cid in reversed(chain):
            r = by_id[cid]
            new = np.asarray(r.new_input_ids, dtype=np.int32)
            if r.parent_request_id is None:
                if r.prefix_len != 0:
                    raise ReconstructionError(f"root record {cid!r} has prefix_len {r.prefix_len}")
                out[cid] = new
                continue
            ctx = context_of(r.parent_request_id)
            if r.prefix_len > len(ctx):
                raise ReconstructionError(
                    f"record {cid!r}: prefix_len {r.prefix_len} > parent context {len(ctx)}"
                )
            out[cid] = np.concatenate([ctx[: r.prefix_len], new])
        return out[rid]

    for rid in by_id:
        full(rid)
    return out


def unique_tokens(records: Iterable[TitoRecord]) -> int:
    """Tokens a session holds once each: every record's new input + output."""
    return sum(len(r.new_input_ids) + len(r.output_ids) for r in records)


def whole_requests(records: Iterable[TitoRecord], rids: Iterable[str]) -> dict[str, str | None]:
    """The request of each call in ``rids`` as the harness sent it, JSON text (``gyre export``):
    a chat call's whole message list, rebuilt along its ``after`` chain (``request_json``
    keeps only what a call added to the call it extends), with its own tools; any other
    request as stored. None where the call, or a call of its chain, has no ``request_json``."""
    by_id = {r.request_id: r for r in records}
    parsed: dict[str, dict | None] = {}
    messages: dict[str, list | None] = {}  # rid -> whole message list (None: unknown)

    def request(rid: str) -> dict | None:
        if rid not in parsed:
            r = by_id.get(rid)
            parsed[rid] = json.loads(r.request_json) if r is not None and r.request_json else None
        return parsed[rid]

    def whole(rid: str) -> list | None:
        chain = []  # rid, its after, ... up to one already rebuilt or the first
        cur: str | None = rid
        while cur is not None and cur not in messages:
            chain.append(cur)
            req = request(cur)
            cur = req.get("after") if req is not None else None
        for c in reversed(chain):
            req = request(c)
            if req is None or not isinstance(req.get("messages"), list):
                messages[c] = None
                continue
            after = req.get("after")
            head = messages.get(after) if after is not None else []
            messages[c] = None if head is None else [*head, *req["messages"]]
        return messages[rid]

    out: dict[str, str | None] = {}
    for rid in rids:
        req = request(rid)
        if req is None or "messages" not in req:
            out[rid] = by_id[rid].request_json if rid in by_id else None
            continue
        msgs = whole(rid)
        rebuilt = {"messages": msgs, **({"tools": req["tools"]} if "tools" in req else {})}
        out[rid] = None if msgs is None else json.dumps(rebuilt)
    return out
