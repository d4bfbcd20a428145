"""`gyre sql` is confined by DuckDB itself: one SELECT, files of the store only, settings
locked. Each bad query gets a clear error and touches nothing (the store's files and the
working directory are compared before and after)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from storage.sql import SqlError, query
from storage.store import Store


def _snapshot(*roots: Path) -> dict[str, int]:
    out = {}
    for root in roots:
        for p in root.rglob("*"):
            out[str(p)] = p.stat().st_size if p.is_file() else -1
    return out


@pytest.fixture()
def store(tmp_path, monkeypatch):
    st = Store(str(tmp_path / "store"))
    st.append(
        "cells",
        [
            {"run_id": "r", "cell_id": f"c{i}", "event": "join", "role": "rollout", "t": 1.0}
            for i in range(2)
        ],
    )
    (tmp_path / "outside.txt").write_text("secret,1\n")
    monkeypatch.chdir(tmp_path)  # a relative COPY target would land here
    return st


def test_select_forms_answer(store):
    assert query(store, "SELECT count(*) AS n FROM cells").to_pylist() == [{"n": 2}]
    assert query(store, "/* a comment */ WITH c AS (SELECT * FROM cells) SELECT count(*) FROM c")
    assert query(store, "FROM cells LIMIT 1").num_rows == 1
    assert query(store, "DESCRIBE cells").num_rows > 0
    assert query(store, "SHOW TABLES").num_rows >= 8
    # reading the store's own files through a table function is allowed
    seg = store.segments("cells")[0]
    assert query(store, f"SELECT count(*) AS n FROM read_parquet('{seg}')").to_pylist() == [
        {"n": 2}
    ]


BAD = [
    # writes, also behind a comment or after a harmless first statement
    ("SELECT 1; COPY (SELECT 42) TO 'x.csv'", "one statement at a time"),
    ("/* x */ COPY (SELECT * FROM cells) TO '{seg_dir}/part-9-dup.parquet'", "read-only"),
    ("COPY cells TO 'y.parquet'", "read-only"),
    ("EXPORT DATABASE 'dump'", "read-only"),
    ("CREATE TABLE t AS SELECT 1", "read-only"),
    ("INSERT INTO cells SELECT * FROM cells", "read-only"),
    ("DROP VIEW cells", "read-only"),
    ("EXPLAIN ANALYZE COPY (SELECT 1) TO 'z.csv'", "read-only"),
    # other databases, extensions, settings
    ("ATTACH 'other.duckdb' AS o", "read-only"),
    ("INSTALL httpfs", "read-only"),
    ("LOAD httpfs", "read-only"),
    ("PRAGMA version", "read-only"),
    ("SET enable_external_access = true", "read-only"),
    ("CALL pragma_version()", "read-only"),
    # files outside the store
    ("SELECT * FROM read_csv('{outside}')", "Permission"),
    ("SELECT * FROM read_text('{outside}')", "Permission"),
    ("SELECT * FROM read_text('{store}/../outside.txt')", "Permission"),
    ("SELECT * FROM glob('/etc/*')", "Permission"),
    ("SELECT * FROM read_text('/etc/hostname')", "Permission"),
    # not SQL at all
    ("SELEC 1", "cannot parse"),
]


@pytest.mark.parametrize("sql, why", BAD)
def test_bad_queries_are_refused_and_touch_nothing(store, tmp_path, sql, why):
    sql = sql.format(
        seg_dir=store.path("cells"), outside=tmp_path / "outside.txt", store=store.root
    )
    before = _snapshot(tmp_path)
    with pytest.raises(SqlError, match=why):
        query(store, sql)
    assert _snapshot(tmp_path) == before
    assert query(store, "SELECT count(*) AS n FROM cells").to_pylist() == [{"n": 2}]
    assert not any(os.path.exists(tmp_path / f) for f in ("x.csv", "y.parquet", "z.csv"))
