import os

import pyarrow as pa
import pytest

from storage.checkpoints import fetch_checkpoint, latest_version, publish_checkpoint, versions
from storage.sql import SqlError, format_table, query
from storage.store import Store, StoreError


def _cell(i):
    return {
        "run_id": "r",
        "cell_id": f"c{i}",
        "event": "join",
        "role": "rollout",
        "weight_version": i,
        "t": 1.0 + i,
        "detail": "",
    }


def test_append_read_segments(tmp_path):
    st = Store(str(tmp_path / "s"))
    assert st.read("cells").num_rows == 0 and st.read("cells").schema.names[0] == "run_id"
    assert st.append("cells", []) is None
    p1 = st.append("cells", [_cell(0), _cell(1)])
    p2 = st.append("cells", [_cell(2)])
    assert p1 != p2 and os.path.basename(p1).startswith("part-")
    t = st.read("cells")
    assert t.num_rows == 3 and sorted(t["weight_version"].to_pylist()) == [0, 1, 2]
    assert not [n for n in os.listdir(st.path("cells")) if n.endswith(".tmp")]
    # extra keys are dropped, missing ones are null: the schema is the contract
    st.append("cells", [{"run_id": "r", "cell_id": "x", "bogus": 1}])
    assert st.read("cells").num_rows == 4


def test_store_pickles_by_url(tmp_path):
    import pickle

    st = Store(str(tmp_path / "s"))
    st2 = pickle.loads(pickle.dumps(st))
    assert st2.url == st.url and st2.protocol == "file"


def test_bad_url():
    with pytest.raises(StoreError):
        Store("")
    with pytest.raises(StoreError):
        Store("nosuchproto://x/y")


def test_sql_views_empty_and_filled(tmp_path):
    st = Store(str(tmp_path / "s"))
    assert query(st, "SELECT count(*) AS n FROM tito").to_pylist() == [{"n": 0}]
    st.append("cells", [_cell(0), _cell(1)])
    rows = query(st, "SELECT cell_id FROM cells ORDER BY cell_id").to_pylist()
    assert rows == [{"cell_id": "c0"}, {"cell_id": "c1"}]
    for bad in ("DROP VIEW cells", "  insert into cells values (1)", "COPY cells TO 'x'"):
        with pytest.raises(SqlError, match="read-only"):
            query(st, bad)
    with pytest.raises(SqlError, match="views: tito"):
        query(st, "SELECT * FROM nope")


def test_format_table():
    t = pa.table({"a": [1, None], "b": ["x" * 100, "y"], "c": [[1] * 20, [2]]})
    out = format_table(t)
    assert "NULL" in out and "..." in out and "(2 rows)" in out and "(20 items)" in out
    assert format_table(t, "csv").splitlines()[0] == "a,b,c"
    assert format_table(t, "json").count("\n") == 1
    with pytest.raises(SqlError):
        format_table(t, "xml")


def test_checkpoints_versions(tmp_path):
    st = Store(str(tmp_path / "s"))
    src = tmp_path / "ck"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"weights")
    (src / "optimizer.pt").write_bytes(b"opt")
    assert latest_version(st, "r") is None
    publish_checkpoint(st, "r", str(src), 0)
    publish_checkpoint(st, "r", str(src), 3)
    os.makedirs(st.path("checkpoints/r/v9"))  # incomplete: no marker
    assert versions(st, "r") == [0, 3] and latest_version(st, "r") == 3
    path = fetch_checkpoint(st, "r", 3)
    with open(os.path.join(path, "model.safetensors"), "rb") as fh:
        assert fh.read() == b"weights"
    with pytest.raises(FileNotFoundError):
        fetch_checkpoint(st, "r", 9)


def test_read_since(tmp_path):
    import time

    st = Store(str(tmp_path / "s"))
    st.append("cells", [_cell(0)])
    t = time.time_ns()
    st.append("cells", [_cell(1)])
    assert st.read("cells", since_ns=t)["cell_id"].to_pylist() == ["c1"]
    assert st.read("cells").num_rows == 2 and len(st.segments("cells", since_ns=0)) == 2
