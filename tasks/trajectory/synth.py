"""Synthetic agent sessions as TITO records, for tests and benches.

``random_session`` simulates an agent the slow, obviously-correct way: it keeps
every call's full context, picks an action (extend the last context, retry or
roll back to an earlier point, reset the context to the system prompt, repeat a
call exactly), and delta-encodes each call against the record whose context
shares the longest prefix, as the gateway does. ``reference_paths`` rebuilds
every call's path with per-token provenance by plain recursion over the records.

``long_rollout`` writes delta records directly (no contexts kept), for the
500-call / 1M-token benchmark.

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from storage.tito import TitoRecord, common_prefix_len
from tasks.trajectory.tree import _PROV_CODE, HARNESS, POLICY, Span


def random_session(
    rng: np.random.Generator,
    *,
    n_calls: int = 12,
    session_id: str = "s0",
    run_id: str = "run",
    vocab: int = 40,
    sys_len: int = 6,
    new_len: tuple[int, int] = (1, 6),
    out_len: tuple[int, int] = (1, 6),
    p_retry: float = 0.2,
    p_reset: float = 0.1,
    p_dup: float = 0.1,
    p_tool: float = 0.3,
    p_version_bump: float = 0.2,
) -> tuple[list[TitoRecord], dict[str, list[Span]]]:
    """Records of one branching session plus tool spans keyed by request id."""
    system = rng.integers(0, vocab, sys_len).astype(np.int32)
    ctxs: list[np.ndarray] = []
    recs: list[TitoRecord] = []
    spans: dict[str, list[Span]] = {}
    version = 0
    for i in range(n_calls):
        rid = f"{session_id}-r{i:03d}"
        u = rng.random()
        if recs and u < p_dup:
            src = recs[int(rng.integers(len(recs)))]
            full = ctxs[recs.index(src)][: len(ctxs[recs.index(src)]) - len(src.output_ids)]
            out, lp, ver = list(src.output_ids), list(src.output_logprobs), src.weight_version
            new_spans: list[Span] = []
            n_new = 0
        else:
            if not recs or u < p_dup + p_reset:
                base = system
            elif u < p_dup + p_reset + p_retry:
                c = ctxs[int(rng.integers(len(ctxs)))]
                base = c[: int(rng.integers(1, len(c) + 1))]
            else:
                base = ctxs[-1]
            n_new = int(rng.integers(new_len[0], new_len[1] + 1))
            full = np.concatenate([base, rng.integers(0, vocab, n_new).astype(np.int32)])
            new_spans = []
            if n_new >= 2 and rng.random() < p_tool:
                lo = int(rng.integers(0, n_new - 1))
                new_spans = [
                    (lo, int(rng.integers(lo + 1, n_new + 1)), str(rng.choice(["tool", "env"])))
                ]
            if rng.random() < p_version_bump:
                version += 1
            ver = version
            n_out = int(rng.integers(out_len[0], out_len[1] + 1))
            out = rng.integers(0, vocab, n_out).tolist()
            lp = _logprobs(full, out, ver)
        parent, k = None, 0
        for j, c in enumerate(ctxs):  # longest shared prefix wins, latest on ties
            kk = common_prefix_len(full, c)
            if kk >= k and kk > 0:
                parent, k = recs[j].request_id, kk
        new_ids = full[k:]
        # spans are relative to new_input_ids: shift by what the prefix swallowed
        shift = len(full) - len(new_ids) - (len(full) - n_new)
        sp = [(lo - shift, hi - shift, p) for lo, hi, p in new_spans if lo - shift >= 0]
        if sp:
            spans[rid] = sp
        recs.append(
            TitoRecord(run_id, session_id, rid, i, parent, k, new_ids.tolist(), out, lp, ver)
        )
        ctxs.append(np.concatenate([full, np.asarray(out, np.int32)]))
    return recs, spans


def _logprobs(context: np.ndarray, out: list[int], version: int) -> list[float]:
    """Behaviour log-probs as a function of (context so far, token, version), as a
    deterministic policy would give: the same call twice gets the same values."""
    seq = np.concatenate([context, np.asarray(out, np.int32)]).astype(np.int32)
    n = len(context)
    return [
        -(zlib.crc32(seq[: n + j + 1].tobytes() + bytes([version % 256])) % 997) / 166.0
        for j in range(len(out))
    ]


def reference_paths(
    records: Sequence[TitoRecord], spans: dict[str, list[Span]] | None = None
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per request id: (tokens, provenance codes, versions, logprobs) of its input +
    output, by recursion over the delta encoding (no tree)."""
    by_id = {r.request_id: r for r in records}
    out: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}

    def ctx(rid: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if rid in out:
            return out[rid]
        r = by_id[rid]
        if r.parent_request_id is None:
            parts = [
                np.zeros(0, np.int32),
                np.zeros(0, np.int8),
                np.zeros(0, np.int64),
                np.zeros(0, np.float32),
            ]
        else:
            parts = [a[: r.prefix_len] for a in ctx(r.parent_request_id)]
        n = len(r.new_input_ids)
        prov = np.full(n, HARNESS, np.int8)
        for lo, hi, name in (spans or {}).get(rid, []):
            prov[lo:hi] = _PROV_CODE[name]
        m = len(r.output_ids)
        res = (
            np.concatenate(
                [
                    parts[0],
                    np.asarray(r.new_input_ids, np.int32),
                    np.asarray(r.output_ids, np.int32),
                ]
            ),
            np.concatenate([parts[1], prov, np.full(m, POLICY, np.int8)]),
            np.concatenate(
                [parts[2], np.full(n, -1, np.int64), np.full(m, r.weight_version, np.int64)]
            ),
            np.concatenate(
                [
                    parts[3],
                    np.full(n, np.nan, np.float32),
                    np.asarray(r.output_logprobs, np.float32).reshape(m),
                ]
            ),
        )
        out[rid] = res
        return res

    for rid in by_id:
        ctx(rid)
    return out


def long_rollout(
    *,
    n_calls: int = 500,
    unique_tokens: int = 1_000_000,
    session_id: str = "long",
    run_id: str = "bench",
    sys_len: int = 2000,
    reset_every: int = 200,
    retry_every: int = 25,
    seed: int = 0,
    vocab: int = 150_000,
) -> list[TitoRecord]:
    """A long agent rollout written directly as delta records.

    Each call extends the previous context with new input and an output of about
    ``unique_tokens / n_calls`` tokens in all; every ``retry_every`` calls one call
    is retried from the previous call's input (a branch), and every
    ``reset_every`` calls the context is reset to the system prompt (summary).
    """
    rng = np.random.default_rng(seed)
    per_call = max(2, (unique_tokens - sys_len) // n_calls)
    recs: list[TitoRecord] = []
    ctx_len: list[int] = []
    for i in range(n_calls):
        n_out = per_call // 2
        n_new = per_call - n_out
        if i == 0:
            parent, k, n_new = None, 0, sys_len + n_new
        elif i % reset_every == 0:
            parent, k = recs[0].request_id, sys_len  # summary after the system prompt
        elif i % retry_every == 0 and i >= 2:
            prev = recs[-1]
            parent, k = prev.parent_request_id, prev.prefix_len  # same context, new input
        else:
            parent, k = recs[-1].request_id, ctx_len[-1]
        new = rng.integers(0, vocab, n_new, dtype=np.int32)
        out = rng.integers(0, vocab, n_out, dtype=np.int32)
        lp = np.full(n_out, -1.0, np.float32)
        recs.append(
            TitoRecord(
                run_id, session_id, f"{session_id}-{i:05d}", i, parent, k, new, out, lp, i // 50
            )
        )
        ctx_len.append(k + n_new + n_out)
    return recs
