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
columns never loads one), once per run and process. Where transformers would decode with
the ``tokenizers`` backend of ``tokenizer.json`` unchanged (a checkpoint saved by
transformers' own fast tokenizer classes: gyre's tiny model, ``gyre model prepare``'s),
that backend is read directly: a tenth of a second cold, where importing transformers
(and torch under it) took 8-30 s from the CLI. Any other checkpoint is decoded by
transformers' ``AutoTokenizer``, so the text is always what transformers would decode.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Protocol

import duckdb
from duckdb import sqltypes

from storage.checkpoints import fetch_tokenizer
from storage.paths import check_run_id
from storage.store import Store

_LOCK = threading.Lock()
_TOKENIZERS: dict[tuple[str, str], Any] = {}

TEXT_VIEWS = ("calls", "transcripts")

# tokenizer classes whose transformers backend is `tokenizers.Tokenizer.from_file` of the
# checkpoint's tokenizer.json as is (no __init__ of their own that rebuilds it)
_PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


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


def tokenizer(store: Store, run_id: str) -> Decoder:
    """The tokenizer of ``run_id`` (its first checkpoint's), loaded once per process: what
    decodes its ids (``decode(ids, skip_special_tokens=False)``) as transformers would."""
    check_run_id(run_id)  # a query names it: never a path out of the store's checkpoints
    key = (store.url, run_id)
    with _LOCK:
        if key not in _TOKENIZERS:
            _TOKENIZERS[key] = load_decoder(fetch_tokenizer(store, run_id))
        return _TOKENIZERS[key]


def load_decoder(path: str) -> Decoder:
    """The decoder of the checkpoint directory ``path``: its tokenizer.json's backend when
    transformers decodes with it unchanged (`plain_backend`), else transformers'."""
    if (backend := plain_backend(path)) is not None:
        return backend
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def plain_backend(path: str) -> Decoder | None:
    """``path``'s tokenizer.json as a ``tokenizers.Tokenizer`` if transformers' ``decode``
    of this checkpoint is that backend's ``decode`` and nothing else, else None. That holds
    when the tokenizer class loads the file as is (`_PLAIN_CLASSES`), no clean-up rewrites
    the text (``clean_up_tokenization_spaces``, which transformers skips for BPE models),
    and every token the config names is in the file (transformers would add a missing one
    under a new id)."""
    file = os.path.join(path, "tokenizer.json")
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("tokenizer_class") not in _PLAIN_CLASSES:
        return None
    if not os.path.isfile(file):
        return None
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(file)
    except Exception:  # a file this tokenizers cannot read: transformers says why
        return None
    bpe = type(backend.model).__name__ == "BPE"  # transformers' own test of the model
    forced = config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
    if config.get("clean_up_tokenization_spaces") and (forced or not bpe):
        return None
    if any(backend.token_to_id(t) is None for t in _named_tokens(config)):
        return None
    return backend


def _named_tokens(config: dict) -> set[str]:
    """The tokens a tokenizer_config.json names (special tokens, added tokens)."""
    named = [config.get(k) for k in config if k.endswith("_token")]
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    named += list(extra.values()) if isinstance(extra, dict) else list(extra)
    named += list((config.get("added_tokens_decoder") or {}).values())
    out = set()
    for t in named:
        if isinstance(t, dict):
            t = t.get("content")
        if isinstance(t, str):
            out.add(t)
    return out


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
