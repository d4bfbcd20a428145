"""The RL loop end to end: Prefect flow on a real LocalCluster, real engine, gateway, DuckDB.

One tiny run on a local store and one on S3 (a moto server started here), each
checked through what a user sees: the SQL views and the CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from storage.sql import VIEW_COUNTS, VIEWS, query
from storage.store import Store
from storage.tito import reconstruct_inputs
from storage.tito_log import table_to_records
from tests.s3 import moto_s3

pytestmark = pytest.mark.integration

GYRE = [sys.executable, "-m", "flows.cli"]  # the console script, from this venv


def _run(store_url: str, audit_dir: Path, seen: dict | None = None) -> dict:
    from flows.rl_run import rl_run

    watcher = None
    if seen is not None:  # the gateway's admin token, read from the live run (for the test)
        stop = threading.Event()
        watcher = threading.Thread(target=_watch_token, args=(seen, stop), daemon=True)
        watcher.start()
    try:
        return rl_run(
            preset="tiny",
            store=store_url,
            overrides=["rollout.group_size=3", f"model.audit_dir={audit_dir}"],
        )
    finally:
        if watcher is not None:
            stop.set()
            watcher.join(timeout=5)


def _watch_token(seen: dict, stop: threading.Event) -> None:
    from flows import live

    while not stop.wait(0.05):
        for objects in list(live._LIVE.values()):
            seen["admin_token"] = objects[1].admin_token


def _audited(audit_dir: Path) -> dict[str, list[int]]:
    seen: dict[str, list[int]] = {}
    for f in audit_dir.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            seen[rec["rid"]] = rec["input_ids"]
    return seen


def _check_run(store: Store, summary: dict, audit_dir: Path) -> None:
    assert summary["steps"] == 2 and summary["weight_version"] == 2
    counts = {r["view"]: r["rows"] for r in query(store, VIEW_COUNTS).to_pylist()}
    assert all(counts[v] > 0 for v in VIEWS), counts
    versions = query(store, "SELECT count(DISTINCT weight_version) AS n FROM tito").to_pylist()
    assert versions[0]["n"] >= 2
    steps = query(store, "SELECT step, weight_version, tokens FROM steps ORDER BY step").to_pylist()
    assert [(s["step"], s["weight_version"]) for s in steps] == [(0, 1), (1, 2)]
    assert all(s["tokens"] > 0 for s in steps)
    # no sample trained twice
    dup = query(store, "SELECT sample_id FROM ledger GROUP BY 1 HAVING count(*) > 1")
    assert dup.num_rows == 0
    # every call's full input, rebuilt from the delta records, is what the engine received
    records = table_to_records(store.read("tito"))
    full = reconstruct_inputs(records)
    received = _audited(audit_dir)
    assert len(records) == summary["calls"] > 0
    for r in records:
        assert full[r.request_id].tolist() == received[r.request_id], r.request_id
    # delta encoding stores far less than the contexts (the harness retries and resets)
    assert summary["tokens_unique"] < summary["tokens_flat"]


@pytest.fixture(scope="module")
def local_run(prefect_harness, tmp_path_factory):
    root = tmp_path_factory.mktemp("local")
    store_dir = root / "data"
    seen: dict = {}
    summary = _run(str(store_dir), root / "audit", seen)
    return store_dir, summary, root / "audit", seen


def test_admin_token_is_in_no_parameter_artifact_or_log(local_run):
    """The gateway's admin token reaches the cells through the Dask scheduler: no flow or
    task run parameter, artifact or log line in the Prefect API holds it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter

    *_, seen = local_run
    token = seen.get("admin_token")
    assert token and len(token) >= 20

    def every(read, *args):  # the API pages by 200
        out: list = []
        while page := read(*args, limit=200, offset=len(out)):
            out += page
        return out

    with get_client(sync_client=True) as client:
        flows = every(client.read_flow_runs)
        tasks = every(client.read_task_runs)
        artifacts = every(client.read_artifacts)
        logs = every(client.read_logs, LogFilter())
    assert any(f.name.endswith("schedule") for f in flows) and tasks and artifacts and logs
    assert {a.key for a in artifacts} >= {
        f"gyre-{k}-{summary_run_id(local_run)}" for k in ("summary", "config", "progress")
    }
    for what, objs in (("flow run", flows), ("task run", tasks), ("artifact", artifacts)):
        for o in objs:
            assert token not in o.model_dump_json(), (
                f"{what} {o.name if hasattr(o, 'name') else o.key}"
            )
    assert not [x.message for x in logs if token in x.message]


def summary_run_id(local_run) -> str:
    return local_run[1]["run_id"].lower()


def test_run_on_local_store(local_run):
    store_dir, summary, audit, _ = local_run
    _check_run(Store(str(store_dir)), summary, audit)


def test_cli_sql_shows_every_view(local_run):
    store_dir, *_ = local_run
    out = subprocess.run(
        GYRE + ["sql", "--store", str(store_dir)], capture_output=True, text=True, check=True
    ).stdout
    for v in VIEWS:
        assert f"\n{v} " in out, out
    out = subprocess.run(
        GYRE
        + [
            "sql",
            "--store",
            str(store_dir),
            "--format",
            "json",
            "SELECT count(DISTINCT weight_version) AS n FROM tito",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out)["n"] >= 2
    bad = subprocess.run(
        GYRE + ["sql", "--store", str(store_dir), "DROP VIEW tito"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "read-only" in bad.stderr


@pytest.fixture(scope="module")
def moto_s3_env(free_port):
    with moto_s3(free_port(), buckets=("gyre-test",)) as server:
        yield server.env


def test_run_on_s3_store(prefect_harness, moto_s3_env, tmp_path):
    url = "s3://gyre-test/runs/a"
    summary = _run(url, tmp_path / "audit")
    store = Store(url)
    assert store.protocol == "s3" and store.segments("tito")
    _check_run(store, summary, tmp_path / "audit")
    out = subprocess.run(
        GYRE + ["sql", "--store", url, "--format", "csv", "SELECT count(*) AS n FROM steps"],
        capture_output=True,
        text=True,
        check=True,
        env=os.environ.copy(),
    ).stdout
    assert out.splitlines() == ["n", "2"]


def test_readme_sql_examples_answer(local_run):
    """Every example query in README.md runs on a real run's store and answers."""
    store_dir, *_ = local_run
    store = Store(str(store_dir))
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("```sql\n", 1)[1].split("```", 1)[0]
    queries = [q.strip() for q in block.split(";") if q.strip()]
    assert len(queries) >= 5
    sid = query(store, "SELECT session_id FROM nodes WHERE n_children > 1 LIMIT 1")
    sid = sid.to_pylist()[0]["session_id"]
    last = f"SELECT request_id FROM tito WHERE session_id = '{sid}' ORDER BY seq_no DESC LIMIT 1"
    rid = query(store, last).to_pylist()[0]["request_id"]
    tables = [
        query(store, q.replace("sess-...", sid).replace("chatcmpl-...", rid)) for q in queries
    ]
    answers = [t.num_rows for t in tables]
    by_subtask, saved, _stale, branches, versions = answers[:5]
    assert by_subtask == 2 and saved == 1 and branches >= 1 and versions >= 2
    # the worst session's transcript reads as text: the arithmetic suite's prompt, the
    # chat template's role markers, and as many calls as that session made
    (worst,) = next(t for q, t in zip(queries, tables, strict=True) if "FROM transcripts" in q
                or "JOIN transcripts" in q).to_pylist()  # fmt: skip
    (fewest,) = query(store, "SELECT session_id, reward FROM rollouts ORDER BY reward, "
                      "session_id LIMIT 1").to_pylist()  # fmt: skip
    assert worst["session_id"] == fewest["session_id"]
    assert "<|im_start|>user" in worst["text"] and "<|im_start|>assistant" in worst["text"]
    calls = next(t for q, t in zip(queries, tables, strict=True) if "FROM calls" in q)
    n = query(store, f"SELECT count(*) AS n FROM tito WHERE session_id = '{worst['session_id']}'")
    assert calls.num_rows == n.to_pylist()[0]["n"] >= 1
    assert any("<|im_start|>" in r["input_text"] for r in calls.to_pylist())
    # the harness's messages: per call from the one it extends, and one call's whole list
    per_call = next(t for q, t in zip(queries, tables, strict=True) if "AS extends" in q)
    assert per_call.num_rows >= 2 and all(r["messages"] for r in per_call.to_pylist())
    (whole,) = next(t for q, t in zip(queries, tables, strict=True) if "RECURSIVE" in q).to_pylist()
    roles = [m["role"] for m in json.loads(whole["messages"])]
    assert roles[0] in ("system", "user") and roles[-1] != "assistant"
