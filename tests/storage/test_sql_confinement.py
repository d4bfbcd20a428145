"""`gyre sql` is confined by DuckDB itself: one SELECT, files of the store only, settings
locked. Each bad query gets a clear error and touches nothing (the store's files and the
working directory are compared before and after)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from storage.sql import SqlError, query
from storage.store import Store, StoreError


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


# -- the quarantine path takes no orders from a query ---------------------------------


@pytest.fixture()
def victim(tmp_path):
    """A directory outside the store with files a query must neither move nor read: one
    that is not Parquet (so it "fails to decode") and one that is."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "victim"
    d.mkdir()
    (d / "notes.parquet").write_text("my notes, not parquet\n")
    pq.write_table(pa.table({"secret": ["s3cret"]}), d / "good.parquet")
    old = 1_000_000_000  # atime far in the past: a read would move it forward
    for f in d.iterdir():
        os.utime(f, (old, old + 10))
    return d


def _atimes(d: Path) -> dict[str, float]:
    return {f.name: f.stat().st_atime for f in d.iterdir()}


def _reads_are_seen(tmp_path: Path) -> bool:
    """Whether this file system moves atime on a read (not under noatime)."""
    probe = tmp_path / "atime-probe"
    probe.write_text("x")
    os.utime(probe, (1_000_000_000, 1_000_000_010))
    probe.read_text()
    seen = probe.stat().st_atime > 1_000_000_010
    probe.unlink()
    return seen


FORGED = [
    # error() writes any text into DuckDB's error, quoted as the old pattern wanted it
    "SELECT error('''{store}/../victim/notes.parquet''')",
    "SELECT error('''{store}/cells/../../victim/notes.parquet''')",
    "SELECT error('\"{store}/../victim/notes.parquet\"')",
    "SELECT error('''{store}/../victim/good.parquet''')",
    # links inside the store that point out of it
    "SELECT error('''{store}/cells/part-0-link.parquet''')",
    "SELECT error('''{store}/elsewhere/notes.parquet''')",
    "SELECT error('''{store}/link.parquet''')",
    # a good segment of the store's own: checked, found good, left where it is
    "SELECT error('''{seg}''')",
    # files outside the store through DuckDB's table functions
    "SELECT * FROM read_parquet('{victim}/good.parquet')",
    "SELECT * FROM read_parquet('{store}/../victim/good.parquet')",
    "SELECT * FROM read_parquet('{store}/cells/part-0-link.parquet')",
    "SELECT * FROM read_parquet('{store}/elsewhere/good.parquet')",
    "SELECT * FROM read_csv('{store}/elsewhere/notes.parquet')",
    "SELECT * FROM read_text('{store}/link.parquet')",
    "SELECT count(*) FROM cells",  # the view meets the link in its dataset directory
]


@pytest.mark.parametrize("sql", FORGED)
def test_no_query_moves_writes_or_reads_a_file_outside_the_store(store, tmp_path, victim, sql):
    if "part-0-link" in sql or "FROM cells" in sql:  # (it breaks the cells view)
        os.symlink(victim / "notes.parquet", Path(store.path("cells", "part-0-link.parquet")))
    os.symlink(victim / "notes.parquet", Path(store.path("link.parquet")))
    os.symlink(victim, Path(store.path("elsewhere")))
    seg = store.segments("cells")[-1]
    sql = sql.format(store=store.root, victim=victim, seg=seg)
    before, atimes = _snapshot(tmp_path), _atimes(victim)
    with pytest.raises(SqlError):
        query(store, sql)
    assert _snapshot(tmp_path) == before  # nothing moved, nothing written, in or out
    assert not store.quarantined
    if _reads_are_seen(tmp_path):
        assert _atimes(victim) == atimes  # and nothing read
    assert (victim / "notes.parquet").read_text() == "my notes, not parquet\n"
    Path(store.path("cells", "part-0-link.parquet")).unlink(missing_ok=True)
    assert query(store, "SELECT count(*) AS n FROM cells").to_pylist() == [{"n": 2}]


def test_duckdb_temp_directory_is_not_readable(store, tmp_path):
    """DuckDB spills to ./.tmp by default and lets queries read it; gyre sql has none."""
    (tmp_path / ".tmp").mkdir()
    (tmp_path / ".tmp" / "spill.txt").write_text("someone else's spill\n")
    for sql in ("SELECT * FROM read_text('.tmp/spill.txt')", "SELECT * FROM glob('.tmp/*')"):
        with pytest.raises(SqlError, match="Permission"):
            query(store, sql)
    temp = query(store, "SELECT current_setting('temp_directory') AS t").to_pylist()[0]["t"]
    assert temp == ""  # no temporary directory at all: nothing to read or to spill into


def _corrupt_a_data_page(path: str) -> None:
    """Flip bytes in the middle of a column chunk's pages; the footer stays intact."""
    import pyarrow.parquet as pq

    col = pq.ParquetFile(path).metadata.row_group(0).column(1)
    start = col.dictionary_page_offset or col.data_page_offset
    data = bytearray(Path(path).read_bytes())
    mid = start + col.total_compressed_size // 2
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
    Path(path).write_bytes(bytes(data))
    assert pq.ParquetFile(path).metadata.num_rows > 0  # the footer still reads


def test_gyre_sql_quarantines_a_page_corrupted_segment_and_answers(store, tmp_path):
    import subprocess
    import sys

    bad = store.append(
        "cells",
        [
            {"run_id": "r", "cell_id": f"b{i}" * 40, "event": "join", "role": "x", "t": float(i)}
            for i in range(200)
        ],
    )
    _corrupt_a_data_page(bad)
    res = subprocess.run(
        [*(sys.executable, "-m", "flows.cli"), "sql", "--store", store.root, "--format", "json"]
        + ["SELECT count(DISTINCT cell_id) AS n FROM cells"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == '{"n": 2}'  # answered from the rest
    assert f"corrupt segment {bad} quarantined" in res.stderr
    assert Path(store.path("_quarantine", "cells", Path(bad).name)).exists()
    assert not Path(bad).exists()


def test_the_store_moves_and_reads_only_its_own_segments(store, tmp_path, victim):
    os.symlink(victim / "notes.parquet", Path(store.path("cells", "part-0-link.parquet")))
    seg = store.segments("cells")[-1]
    assert store.own_segment(seg) == seg
    assert store.own_segment(f"{store.root}/cells/../cells/{Path(seg).name}") == seg
    before = _snapshot(tmp_path)
    for path in (
        f"{store.root}/../victim/notes.parquet",
        f"{store.root}/cells/../../victim/notes.parquet",
        store.path("cells", "part-0-link.parquet"),  # a link out of the store
        store.path("_quarantine", "cells", "part-1.parquet"),  # not a dataset directory
        store.path("cells", "notes.parquet"),  # not a segment's name
    ):
        assert store.own_segment(path) is None
        with pytest.raises(StoreError, match="not"):
            store.quarantine(path, "told to")
        with pytest.raises(StoreError, match="not a segment"):
            store.read_segment(path)
    assert _snapshot(tmp_path) == before and not store.quarantined
