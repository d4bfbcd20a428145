"""`gyre sql` runs each query under a memory and a time limit: an endless recursive CTE is
stopped, a query larger than the limit fails, each with a message naming the setting; and
the locked configuration cannot lift them from inside a query."""

from __future__ import annotations

import subprocess
import sys
import time

import duckdb
import pytest

from storage.sql import DEFAULT_MEMORY_LIMIT, SqlError, query
from storage.store import Store

ENDLESS = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT max(i) FROM r"
LARGE = "SELECT list(range) AS l FROM range(60000000) GROUP BY range % 3"


@pytest.fixture()
def store(tmp_path):
    st = Store(str(tmp_path / "store"))
    st.append("cells", [{"run_id": "r", "cell_id": "c0", "event": "join", "role": "rollout"}])
    return st


def test_an_endless_query_is_stopped_at_the_time_limit(store):
    t0 = time.monotonic()
    with pytest.raises(SqlError, match=r"time limit \(1 s\).*--timeout"):
        query(store, ENDLESS, timeout_s=1.0)
    assert time.monotonic() - t0 < 60  # stopped, not run until memory runs out


def test_a_query_over_the_memory_limit_fails_naming_the_setting(store):
    with pytest.raises(SqlError, match=r"memory limit \(64MB\).*--memory-limit"):
        query(store, LARGE, memory_limit="64MB", timeout_s=120)


def test_the_limit_is_duckdbs_own_setting_and_locked(store):
    def setting(**kw) -> str:
        sql = "SELECT current_setting('memory_limit') AS m"
        return query(store, sql, **kw).to_pylist()[0]["m"]

    def duckdb_spelling(limit: str) -> str:  # how DuckDB itself shows that limit
        con = duckdb.connect(":memory:", config={"memory_limit": limit})
        return con.execute("SELECT current_setting('memory_limit')").fetchone()[0]

    default = (
        duckdb.connect(":memory:").execute("SELECT current_setting('memory_limit')").fetchone()
    )
    assert setting() == duckdb_spelling(DEFAULT_MEMORY_LIMIT) != default[0]
    assert setting(memory_limit="64MB") == duckdb_spelling("64MB")
    with pytest.raises(SqlError):
        query(store, "SET memory_limit = '20GB'")


def test_a_bad_memory_limit_is_refused_clearly(store):
    with pytest.raises(SqlError, match="--memory-limit 'lots'"):
        query(store, "SELECT 1", memory_limit="lots")


def test_gyre_sql_cli_stops_an_endless_query_and_says_which_flag(store):
    gyre = [sys.executable, "-m", "flows.cli"]
    out = subprocess.run(
        [*gyre, "sql", "--store", store.url, "--timeout", "1", ENDLESS],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out
    assert "--timeout" in out.stderr and "Traceback" not in out.stderr
    helptext = subprocess.run([*gyre, "sql", "--help"], capture_output=True, text=True).stdout
    assert DEFAULT_MEMORY_LIMIT in helptext and "300" in helptext


def test_gyre_sql_without_a_query_lists_the_text_views_too(store):
    out = query(store, __import__("storage.sql", fromlist=["x"]).VIEW_COUNTS).to_pylist()
    assert {"calls", "transcripts"} <= {r["view"] for r in out}
