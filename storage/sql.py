"""DuckDB over the store: one read-only view per dataset.

Views: ``tito``, ``nodes``, ``scores``, ``rollouts``, ``samples``, ``steps``,
``ledger``, ``cells``, ``evals`` (schemas in storage/schemas.py), and the text views
``calls`` and ``transcripts`` with the function ``detokenize(run_id, ids)``
(storage/transcripts.py). Parquet on S3 is read
through the store's s3fs file system registered with DuckDB (no httpfs
extension needed). Connections are short-lived and in-memory, so queries never
contend for a database file lock with a running flow.

Confinement is DuckDB's own, not a pattern on the text: the query is parsed with
DuckDB's statement API and must be exactly one SELECT (``WITH``, ``FROM x``,
``DESCRIBE``, ``SHOW`` and ``SUMMARIZE`` parse as SELECT); the connection then
runs with ``enable_external_access=false`` and the store as its only allowed
directory, and ``lock_configuration`` refuses any attempt to change that. So
COPY/ATTACH/INSTALL/LOAD/PRAGMA/SET, a second statement, and files outside the
store are all refused before anything is touched. DuckDB resolves links before it
checks a path, so a link in the store pointing out of it is refused too. The
connection has no temporary directory (DuckDB's default, ``./.tmp``, would be a
readable place outside the store), so a query larger than memory fails, never spills.

A query can put any text in an error (``error('...')``), so an error's text never
decides what is moved: see `query`.

Limits: a query gets at most ``memory_limit`` of memory (DuckDB's own default is 80% of the
machine, which starves a run going on beside it) and ``timeout_s`` of wall time (an endless
recursive CTE is interrupted); either one, when hit, is a ``SqlError`` naming the setting
and how to raise it.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import duckdb
import pyarrow as pa

from storage.schemas import SCHEMAS
from storage.store import Store
from storage.transcripts import TEXT_VIEWS
from storage.transcripts import register as register_text

VIEWS = tuple(SCHEMAS)

DEFAULT_MEMORY_LIMIT = "4GB"  # gyre sql --memory-limit
DEFAULT_TIMEOUT_S = 300.0  # gyre sql --timeout


class SqlError(ValueError):
    """A query was refused or failed; the message says why."""


def _allowed_roots(store: Store) -> list[str]:
    """The store's root in the spellings DuckDB may hand to a file system (DuckDB
    resolves links before it checks a local path, so the resolved root too)."""
    if store.protocol == "file":
        roots = {store.root, os.path.realpath(store.root)}
        return sorted(r.rstrip("/") + "/" for r in roots)
    root = store.root.strip("/")
    return [f"{store.protocol}://{root}/", f"{store.protocol}:///{root}/"]


def connect(store: Store, memory_limit: str = DEFAULT_MEMORY_LIMIT) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with a view per dataset of the store, able to
    read files under the store's root and nothing else (see the module docstring), and
    to use at most ``memory_limit`` (DuckDB's spelling: ``512MB``, ``4GB``)."""
    # no temporary directory: DuckDB's default (./.tmp) would be a readable place
    # outside the store; a query that does not fit in memory fails instead of spilling
    try:
        con = duckdb.connect(
            ":memory:", config={"temp_directory": "", "memory_limit": memory_limit}
        )
    except duckdb.Error as exc:
        raise SqlError(
            f"--memory-limit {memory_limit!r}: {exc}; use a size such as 512MB or 4GB"
        ) from exc
    if store.protocol != "file":
        con.register_filesystem(store.fs)
    con.execute("SET allowed_directories = ?", [_allowed_roots(store)])
    con.execute("SET enable_external_access = false")
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute("SET enable_progress_bar = false")  # drawn on stdout past 2 s, among the rows
    con.execute("SET lock_configuration = true")
    for name in VIEWS:
        # every column of the schema, in its order, even where no segment has it yet (a
        # column added after the segments were written reads as null)
        source = _empty_select(con, name, SCHEMAS[name])
        if store.segments(name):
            if store.protocol == "file":
                glob = store.path(name, "part-*.parquet")
            else:
                glob = store.full_url(name, "part-*.parquet")
            source += f" UNION ALL BY NAME SELECT * FROM read_parquet('{glob}', union_by_name=true)"
        con.execute(f"CREATE VIEW {name} AS {source}")
    register_text(con, store)  # detokenize(), calls, transcripts (storage/transcripts.py)
    return con


_SQL_TYPES = {
    pa.string(): "VARCHAR",
    pa.int32(): "INTEGER",
    pa.int64(): "BIGINT",
    pa.float32(): "FLOAT",
    pa.float64(): "DOUBLE",
    pa.bool_(): "BOOLEAN",
}


def _sql_type(t: pa.DataType) -> str | None:
    if pa.types.is_list(t):
        inner = _sql_type(t.value_type)
        return None if inner is None else f"{inner}[]"
    return _SQL_TYPES.get(t)


def _empty_select(con: duckdb.DuckDBPyConnection, name: str, schema: pa.Schema) -> str:
    """A SELECT of no rows with ``schema``'s columns and types: typed NULLs in SQL where
    every type has a spelling here (registering an Arrow table makes DuckDB import pandas,
    a third of a cold `gyre sql`), else the empty Arrow table itself."""
    types = [_sql_type(f.type) for f in schema]
    if all(types):
        cols = ", ".join(
            f'CAST(NULL AS {t}) AS "{f.name}"' for f, t in zip(schema, types, strict=True)
        )
        return f"SELECT {cols} WHERE false"
    con.register(f"_empty_{name}", schema.empty_table())
    return f"SELECT * FROM _empty_{name}"


# row count of every view: what `gyre sql` shows without a query
# (the text views too: counting them decodes nothing, DuckDB drops the unused text columns)
VIEW_COUNTS = " UNION ALL ".join(
    f"SELECT '{v}' AS view, count(*) AS rows FROM {v}" for v in VIEWS + TEXT_VIEWS
)


def check_read_only(sql: str) -> None:
    """Refuse anything but exactly one SELECT statement, as DuckDB itself parses it."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise SqlError(f"cannot parse the query: {exc}") from exc
    if len(statements) != 1:
        raise SqlError(
            f"gyre sql runs one statement at a time; got {len(statements)}: "
            "send each SELECT on its own"
        )
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        raise SqlError(
            f"gyre sql is read-only: a {kind.name} statement is refused; use SELECT or WITH "
            "(DESCRIBE, SHOW and SUMMARIZE work too)"
        )


MAX_QUARANTINES_PER_QUERY = 64


def query(
    store: Store,
    sql: str,
    *,
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> pa.Table:
    """Run one read-only query; returns an Arrow table.

    ``memory_limit`` bounds the query's memory and ``timeout_s`` its wall time (None: no
    limit); hitting either is a ``SqlError`` that names the setting.

    When DuckDB fails on a segment, the store checks that segment itself: it must be one
    of its own (`Store.own_segment`) and fail to decode in full with pyarrow; only then
    is it quarantined (``Store.quarantine``: moved aside, logged, listed in
    ``store.quarantined``) and the query runs again without it. The error's text only
    says which of the store's segments to check, since a query can write any text into
    an error (``error('...')``).
    """
    check_read_only(sql)
    for _ in range(MAX_QUARANTINES_PER_QUERY + 1):
        try:
            con = connect(store, memory_limit)
        except duckdb.Error as exc:
            if _quarantine_named_segment(store, exc):
                continue
            raise SqlError(f"cannot open the store's views: {exc}") from exc
        timer = None
        if timeout_s is not None:
            timer = threading.Timer(timeout_s, con.interrupt)
            timer.daemon = True
            timer.start()
        try:
            return con.sql(sql).to_arrow_table()
        except duckdb.InterruptException as exc:
            raise SqlError(
                f"the query ran past the time limit ({timeout_s:g} s) and was stopped; "
                "narrow it, or raise the limit with --timeout SECONDS"
            ) from exc
        except duckdb.OutOfMemoryException as exc:
            raise SqlError(
                # DuckDB's own advice (SET ...) is for unlocked connections: its first line only
                f"the query needs more than the memory limit ({memory_limit}) "
                f"({str(exc).splitlines()[0]}); narrow it, or raise the limit with "
                "--memory-limit (e.g. 8GB)"
            ) from exc
        except duckdb.Error as exc:
            if _quarantine_named_segment(store, exc):
                continue
            raise SqlError(f"{exc}\nviews: {', '.join(VIEWS + TEXT_VIEWS)}") from exc
        finally:
            if timer is not None:
                timer.cancel()
            con.close()
    raise SqlError(f"more than {MAX_QUARANTINES_PER_QUERY} corrupt segments: check {store.url}")


def _quarantine_named_segment(store: Store, exc: duckdb.Error) -> bool:
    """Quarantine the store's segments that a DuckDB error names, if the store finds
    them corrupt; whether any was."""
    text = str(exc)
    if "part-" not in text:  # names no segment (a typo, a missing column...)
        return False
    found = False
    for name in VIEWS:
        for seg in store.segments(name):
            if seg.rsplit("/", 1)[-1] in text and (own := store.own_segment(seg)) is not None:
                found |= store.read_segment(own) is None  # None: corrupt, now quarantined
    return found


def format_table(table: pa.Table, fmt: str = "table", max_width: int = 60) -> str:
    """Render a query result as an aligned text table, CSV, or JSON lines."""
    rows = table.to_pylist()
    cols = table.column_names
    if fmt == "json":
        import json

        return "\n".join(json.dumps(r, default=str) for r in rows)
    if fmt == "csv":
        import csv
        import io

        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")  # LF, as every other line gyre prints
        w.writerow(cols)
        for r in rows:
            w.writerow([_cell(r[c], 10**9) for c in cols])
        return buf.getvalue().rstrip("\n")
    if fmt != "table":
        raise SqlError(f"--format {fmt!r}: use table, csv or json")
    cells = [[_cell(r[c], max_width) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    line = "+".join("-" * (w + 2) for w in widths)
    out = [" | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)), line]
    out += [" | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out)


def _cell(v: Any, max_width: int) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        s = f"{v:.6g}"
    elif isinstance(v, list) and len(v) > 8:
        s = "[" + ", ".join(str(x) for x in v[:8]) + f", ... ({len(v)} items)]"
    else:
        s = str(v)
    return s if len(s) <= max_width else s[: max_width - 3] + "..."
