"""Trajectories as text in SQL: the ``calls`` and ``transcripts`` views and ``detokenize``
decode a run's tokens with the run's own tokenizer (its v0 checkpoint in the store)."""

from __future__ import annotations

import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from infra.engine.tiny_model import make_tiny_model
from storage.checkpoints import publish_checkpoint
from storage.schemas import TITO_SCHEMA
from storage.sql import SqlError, format_table, query
from storage.store import Store
from storage.tito_log import table_to_records


def _call(run_id, sid, seq, new_ids, out_ids, parent=None, prefix=0):
    return {
        "run_id": run_id, "session_id": sid, "request_id": f"{sid}-{seq}", "seq_no": seq,
        "parent_request_id": parent, "prefix_len": prefix, "new_input_ids": new_ids,
        "output_ids": out_ids, "output_logprobs": [0.0] * len(out_ids), "weight_version": 0,
        "cell_id": "c0", "finish_reason": "stop", "cached_tokens": 0, "t_start": float(seq),
        "t_end": seq + 0.5, "endpoint": "chat",
    }  # fmt: skip


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    st = Store(str(tmp_path_factory.mktemp("store")))
    model = make_tiny_model()
    publish_checkpoint(st, "r1", model, 0)
    tok = AutoTokenizer.from_pretrained(model)
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    first = ids("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    rows = [
        _call("r1", "s1", 0, first, ids("5")),
        _call(
            "r1",
            "s1",
            1,
            ids("<|im_end|>\n<|im_start|>user\nAnd 4+4?"),
            ids("8"),
            parent="s1-0",
            prefix=len(first) + 1,
        ),
        _call("r1", "s2", 0, ids("hello"), ids(" world")),
    ]
    st.append("tito", pa.Table.from_pylist(rows, schema=TITO_SCHEMA))
    return st


def test_calls_view_decodes_input_delta_and_output(store):
    rows = query(
        store,
        "SELECT session_id, seq_no, input_text, output_text, output_tokens FROM calls "
        "ORDER BY session_id, seq_no",
    ).to_pylist()
    assert [(r["session_id"], r["seq_no"]) for r in rows] == [("s1", 0), ("s1", 1), ("s2", 0)]
    assert "What is 2+3?" in rows[0]["input_text"] and rows[0]["output_text"] == "5"
    assert rows[1]["input_text"].endswith("And 4+4?") and rows[1]["output_text"] == "8"
    assert rows[2]["input_text"] == "hello" and rows[2]["output_text"] == " world"


def test_transcripts_view_reads_a_session_in_order(store):
    (row,) = query(store, "SELECT text, calls FROM transcripts WHERE session_id = 's1'").to_pylist()
    assert row["calls"] == 2
    text = row["text"]
    assert text.index("What is 2+3?") < text.index("5<|im_end|>") < text.index("And 4+4?8")
    assert query(store, "SELECT detokenize('r1', [])  AS t").to_pylist() == [{"t": ""}]


def test_a_run_without_a_checkpoint_says_why(store):
    store.append("tito", pa.Table.from_pylist([_call("nockpt", "x", 0, [1], [2])], TITO_SCHEMA))
    with pytest.raises(SqlError, match="no checkpoint"):
        query(store, "SELECT output_text FROM calls WHERE run_id = 'nockpt'")
    # a query that does not read the text never needs a tokenizer
    assert query(store, "SELECT count(*) AS n FROM calls").to_pylist() == [{"n": 4}]


@pytest.mark.parametrize("run_id", ["..", "../..", "r1/../../x", "/etc", ""])
def test_detokenize_never_reads_outside_the_store(store, run_id):
    with pytest.raises(SqlError, match="run id"):
        query(store, f"SELECT detokenize('{run_id}', [1, 2]) AS t")


def test_csv_has_lf_line_endings(store):
    out = format_table(query(store, "SELECT 1 AS a, 'x' AS b UNION ALL SELECT 2, 'y'"), "csv")
    assert "\r" not in out and out.split("\n") == ["a,b", "1,x", "2,y"]


def test_segments_written_before_request_json_still_read(tmp_path):
    """A store written before ``request_json``/``response_json`` existed: ``Store.read``, the
    views and ``calls`` read those columns as null, alone and next to newer segments."""
    st = Store(str(tmp_path / "store"))
    old = pa.schema([f for f in TITO_SCHEMA if f.name not in ("request_json", "response_json")])
    os.makedirs(st.path("tito"))
    seg = st.path("tito", f"part-{time.time_ns():020d}-00000000.parquet")
    pq.write_table(pa.Table.from_pylist([_call("r1", "old", 0, [1], [2])], schema=old), seg)
    sql = "SELECT session_id, request_json FROM calls ORDER BY session_id"
    assert query(st, sql).to_pylist() == [{"session_id": "old", "request_json": None}]
    assert query(st, "SELECT response_json FROM tito").to_pylist() == [{"response_json": None}]
    (rec,) = table_to_records(st.read("tito"))
    assert rec.request_json is None and rec.response_json is None
    new = _call("r1", "new", 0, [1], [2]) | {"request_json": '{"messages": []}'}
    st.append("tito", pa.Table.from_pylist([new], schema=TITO_SCHEMA))
    assert query(st, sql).to_pylist() == [
        {"session_id": "new", "request_json": '{"messages": []}'},
        {"session_id": "old", "request_json": None},
    ]
    assert st.read("tito").column("request_json").to_pylist() == [None, '{"messages": []}']
