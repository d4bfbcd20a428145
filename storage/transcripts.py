"""Trajectories as text in SQL: each run's tokens decoded with the run's own tokenizer.

The ``tito`` view holds token ids only. ``connect`` (storage/sql.py) adds, on every
connection, a DuckDB function and two views over it:

- ``detokenize(run_id, ids)``: the text of ``ids`` under the tokenizer of ``run_id``'s
  first checkpoint (``checkpoints/{run_id}/v0``: the model the calls were tokenised with),
  special tokens kept, so a chat template's role markers show who said what;
- ``calls``: one row per model call: ``input_text`` (the call's new input: what the harness
  added since its parent call, template and tool text included), ``output_text`` (what the
  policy generated), ``request_json`` (the request as the harness sent it, JSON: see
  `storage.schemas.TITO_SCHEMA`), with the call's ids, version, finish reason and token
  counts;
- ``transcripts``: one row per session: its calls' input deltas and outputs in order, as
  one text (a retry or reset shows as the text it starts again from).

The tokenizer is loaded on the first row that needs it (a query that does not read the text
columns never loads one), once per run and process. Nothing here imports transformers
unless a text column is read.
"""

from __future__ import annotations

import threading
from typing import Any

import duckdb
from duckdb import sqltypes

from storage.checkpoints import fetch_tokenizer
from storage.paths import check_run_id
from storage.store import Store

_LOCK = threading.Lock()
_TOKENIZERS: dict[tuple[str, str], Any] = {}

TEXT_VIEWS = ("calls", "transcripts")

CALLS_SQL = """
SELECT run_id, session_id, request_id, seq_no, parent_request_id, weight_version,
       endpoint, finish_reason, len(new_input_ids) AS input_tokens,
       len(output_ids) AS output_tokens,
       detokenize(run_id, new_input_ids) AS input_text,
       detokenize(run_id, output_ids) AS output_text,
       request_json, t_start, t_end
FROM tito
"""

TRANSCRIPTS_SQL = """
SELECT run_id, session_id, count(*) AS calls,
       sum(len(output_ids)) AS output_tokens,
       string_agg(detokenize(run_id, new_input_ids) || detokenize(run_id, output_ids), ''
                  ORDER BY seq_no) AS text
FROM tito GROUP BY run_id, session_id
"""


def tokenizer(store: Store, run_id: str) -> Any:
    """The tokenizer of ``run_id`` (its first checkpoint's), loaded once per process."""
    check_run_id(run_id)  # a query names it: never a path out of the store's checkpoints
    key = (store.url, run_id)
    with _LOCK:
        if key not in _TOKENIZERS:
            from transformers import AutoTokenizer

            _TOKENIZERS[key] = AutoTokenizer.from_pretrained(fetch_tokenizer(store, run_id))
        return _TOKENIZERS[key]


def register(con: duckdb.DuckDBPyConnection, store: Store) -> None:
    """``detokenize`` and the text views on ``con`` (after the ``tito`` view exists)."""

    def detokenize(run_id: str, ids: list[int]) -> str:
        return tokenizer(store, run_id).decode(ids, skip_special_tokens=False)

    con.create_function(
        "detokenize",
        detokenize,
        [sqltypes.VARCHAR, duckdb.list_type(sqltypes.INTEGER)],
        sqltypes.VARCHAR,
        side_effects=False,
    )
    con.execute(f"CREATE VIEW calls AS {CALLS_SQL}")
    con.execute(f"CREATE VIEW transcripts AS {TRANSCRIPTS_SQL}")
