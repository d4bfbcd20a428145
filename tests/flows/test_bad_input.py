"""The bad inputs of README's table, each tried as a user would (the `gyre` command), each
refused before anything starts: exit 2, every problem named with its fix, no traceback,
nothing created."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.s3 import moto_s3

pytestmark = pytest.mark.integration

GYRE = [sys.executable, "-m", "flows.cli"]


def _gyre(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*GYRE, *args], capture_output=True, text=True, timeout=timeout, env=env or os.environ
    )


def _refused(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    for n in needles:
        assert n in res.stderr, res.stderr


@pytest.fixture()
def not_a_checkpoint(tmp_path):
    d = tmp_path / "some-dir"
    d.mkdir()
    (d / "notes.txt").write_text("hello")
    return d


RUN_CASES = [
    # (overrides, what the error names)
    (["store=ftp://host/x"], "store='ftp://host/x': unknown protocol"),
    (["cluster.memory_limit=lots"], "cluster.memory_limit='lots': not a size"),
    (["cluster.scheduler_address=hello"], "not a scheduler address"),
    (["run_id=../../../escaped"], "run_id='../../../escaped': a run id becomes a directory"),
    (["rollout.group_size=1000000"], "rollout.group_size=1000000"),
    (["train.steps=1e12"], "train.steps=1000000000000.0"),
    (["train.steps=true"], "train.steps=True"),
    (["rollout.timeout_s=0.001"], "rollout.timeout_s=0.001"),
    (["train.stepz=3"], "did you mean 'train.steps'"),
]


@pytest.mark.parametrize("overrides, needle", RUN_CASES)
def test_gyre_run_refuses_bad_settings_at_once(tmp_path, overrides, needle):
    t0 = time.monotonic()
    res = _gyre("run", "--store", str(tmp_path / "store"), *overrides)
    _refused(res, needle)
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "store").exists()  # nothing started, nothing created
    assert not (tmp_path / "escaped").exists()


def test_world_checks_are_reported_together(tmp_path, free_port, not_a_checkpoint):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    nobody = free_port()  # nothing listens there
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    try:
        res = _gyre(
            "run",
            "--store",
            str(blocker / "store"),  # under a file: cannot be created
            f"gateway.port={busy.getsockname()[1]}",
            f"cluster.scheduler_address=tcp://127.0.0.1:{nobody}",
            f"model.path={not_a_checkpoint}",
        )
    finally:
        busy.close()
    _refused(
        res,
        "store=",
        "gateway.port=",
        "is in use",
        "cluster.scheduler_address=",
        "no Dask scheduler answers",
        "model.path=",
        "not a checkpoint",
    )


def test_missing_bucket_is_refused_for_runs_and_queries(tmp_path, free_port):
    with moto_s3(free_port(), buckets=("exists",)) as server:
        env = {**os.environ, **server.env}
        _refused(_gyre("run", "--store", "s3://no-such-bucket/runs", env=env), "no store at")
        _refused(_gyre("sql", "--store", "s3://no-such-bucket/runs", env=env), "no store at")


def test_gyre_sql_refuses_a_missing_store_and_creates_nothing(tmp_path):
    _refused(_gyre("sql", "--store", str(tmp_path / "nowhere")), "no store at")
    assert not (tmp_path / "nowhere").exists()


def test_gyre_sql_refuses_writes(tmp_path):
    from storage.store import Store

    Store(str(tmp_path / "s")).append(
        "cells", [{"run_id": "r", "cell_id": "c", "event": "join", "role": "x", "t": 1.0}]
    )
    _refused(
        _gyre("sql", "--store", str(tmp_path / "s"), "SELECT 1; COPY (SELECT 42) TO 'x.csv'"),
        "one statement at a time",
    )
    ok = _gyre(
        "sql", "--store", str(tmp_path / "s"), "--format", "json", "SELECT count(*) AS n FROM cells"
    )
    assert json.loads(ok.stdout) == {"n": 1}


def test_resume_from_a_missing_store_is_refused_at_once(tmp_path):
    t0 = time.monotonic()
    res = _gyre("run", "--resume", "lagtest", "--store", str(tmp_path / "nowhere"))
    _refused(res, "--resume lagtest", f"no store at {tmp_path / 'nowhere'}", "started on")
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "nowhere").exists()


def test_unknown_keys_and_bad_values_are_reported_together(tmp_path):
    res = _gyre(
        "run", "--store", str(tmp_path / "store"), "train.stepz=3", "rollout.group_size=0",
        "train.loss=sgd", "nosuch.section=1",
    )  # fmt: skip
    _refused(
        res,
        "train.stepz=3: unknown setting; did you mean 'train.steps'",
        "nosuch.section=1: unknown setting",
        "rollout.group_size=0",
        "train.loss='sgd'",
    )
    assert not (tmp_path / "store").exists()


def test_config_and_world_errors_are_reported_together(tmp_path, free_port, not_a_checkpoint):
    """A config with errors still has its valid world settings checked (nothing created)."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    common = [
        "train.stepz=3",  # unknown
        "rollout.group_size=0",  # a bad value
        f"gateway.port={busy.getsockname()[1]}",
        f"cluster.scheduler_address=tcp://127.0.0.1:{free_port()}",
        f"model.path={not_a_checkpoint}",
    ]
    try:
        res = _gyre("run", "--store", str(blocker / "store"), *common)
        fresh = _gyre("run", "--store", str(tmp_path / "fresh"), *common, "store=ftp://x/y")
    finally:
        busy.close()
    _refused(
        res,
        "did you mean 'train.steps'",
        "rollout.group_size=0",
        f"store='{blocker / 'store'}': cannot create it: {blocker} is not a directory",
        "is in use",
        "no Dask scheduler answers",
        "not a checkpoint",
    )
    # a world setting with a bad value is reported once, never checked at its default
    _refused(fresh, "store='ftp://x/y': unknown protocol", "is in use", "not a checkpoint")
    assert "gyre-data" not in fresh.stderr
    assert not (tmp_path / "fresh").exists()
    assert not list(tmp_path.glob("**/_preflight"))
