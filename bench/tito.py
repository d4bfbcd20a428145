"""TITO storage cost: bytes stored for one long session vs unique tokens x 4 B vs naive.

A synthetic agent session (default: 200 calls reaching ~200K tokens, with a few rollback
branches) is written through the real ``TitoLog`` into a fresh local store; the Parquet
segments' size is compared with (unique tokens x 4 bytes) and with the naive layout that stores
every call's full context. Target (DESIGN.md §8): stored / unique <= 1.1.

    python bench/tito.py [--quick] [--turns 200] [--tokens 200000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from storage.store import Store
from storage.tito import TitoRecord, common_prefix_len
from storage.tito_log import TitoLog, table_to_records, tito_bytes_report


def synthetic_session(turns: int, tokens: int, *, vocab: int = 151_000, seed: int = 0):
    """Records of one session: each call = previous context + tool/user text; some rollbacks.

    Token ids are Zipf-distributed over the vocabulary (as in real text); logprobs look like
    sampled-token logprobs (mostly close to 0).
    """
    rng = np.random.default_rng(seed)
    per_turn = tokens // turns
    n_out = max(1, per_turn // 4)
    n_in = per_turn - n_out

    def toks(n: int) -> np.ndarray:
        return np.minimum(rng.zipf(1.2, n), vocab - 1).astype(np.int32)

    contexts: list[np.ndarray] = []  # input + output of each call
    recs: list[TitoRecord] = []
    ctx = np.zeros(0, dtype=np.int32)
    for i in range(turns):
        if i and i % 50 == 0:  # rollback: drop the last 3 turns' context (a branch)
            ctx = contexts[i - 4]
        full_in = np.concatenate([ctx, toks(n_in)])
        out = toks(n_out)
        best, k = None, 0
        for j in range(max(0, i - 8), i):  # parent: longest shared prefix (recent calls)
            kk = common_prefix_len(full_in, contexts[j])
            if kk > k:
                best, k = j, kk
        recs.append(
            TitoRecord(
                run_id="bench",
                session_id="s0",
                request_id=f"chatcmpl-{i:032x}",
                seq_no=i,
                parent_request_id=None if best is None else recs[best].request_id,
                prefix_len=k,
                new_input_ids=full_in[k:],
                output_ids=out,
                output_logprobs=-np.abs(rng.gumbel(0, 0.3, n_out)).astype(np.float32),
                weight_version=1,
                cell_id="c0",
                t_start=float(i),
                t_end=float(i) + 0.5,
                endpoint="chat",
            )
        )
        ctx = np.concatenate([full_in, out])
        contexts.append(ctx)
    return recs


def measure(turns: int = 200, tokens: int = 200_000) -> dict:
    """Write one synthetic session through the real TitoLog; bytes stored vs unique vs naive."""
    recs = synthetic_session(turns, tokens)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(os.path.join(tmp, "store"))
        t0 = time.perf_counter()
        log = TitoLog(store, os.path.join(tmp, "spool"), flush_records=512, flush_seconds=60)
        for r in recs:
            log.append(r)
        log.close()
        dt = time.perf_counter() - t0
        stored = store.dataset_bytes("tito")
        back = table_to_records(store.read("tito"))
        rep = tito_bytes_report(back, stored_bytes=stored)
        rep["segments"] = len(store.segments("tito"))
    rep["append_ms_per_record"] = 1e3 * dt / len(recs)
    out = {
        "tito_bytes_over_unique": rep["stored_over_unique"],
        "naive_bytes_over_unique": rep["naive_bytes"] / max(1, rep["unique_bytes"]),
        **rep,
    }
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--quick", action="store_true", help="same size (it takes seconds)")
    ap.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = ap.parse_args(argv)
    out = measure(args.turns, args.tokens)
    print(f"{'metric':<28}{'value':>16}")
    for k in (
        "records",
        "unique_tokens",
        "flat_tokens",
        "unique_bytes",
        "stored_bytes",
        "naive_bytes",
        "tito_bytes_over_unique",
        "naive_bytes_over_unique",
        "segments",
        "append_ms_per_record",
    ):
        v = out[k]
        print(f"{k:<28}{v:>16.3f}" if isinstance(v, float) else f"{k:<28}{v:>16}")
    print(
        f"target stored/unique <= 1.1: {'met' if out['tito_bytes_over_unique'] <= 1.1 else 'NOT met'}"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return out


if __name__ == "__main__":
    main()
