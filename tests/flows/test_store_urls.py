"""Store URLs that cannot work are refused at once, through the `gyre` command: exit 2, one
paragraph naming the setting, the value, why and the fix, no traceback, nothing created."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.s3 import moto_s3

pytestmark = pytest.mark.integration

GYRE = [sys.executable, "-m", "flows.cli"]


def _refused(args: list[str], *needles: str, env: dict | None = None) -> str:
    t0 = time.monotonic()
    res = subprocess.run(
        [*GYRE, *args], capture_output=True, text=True, timeout=60, env=env or os.environ
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    for n in needles:
        assert n in res.stderr, res.stderr
    assert time.monotonic() - t0 < 20  # at once: no Prefect, no cells started
    return res.stderr


@pytest.mark.parametrize("cmd", ["run", "sql"])
def test_s3_without_a_bucket(tmp_path, cmd):
    for url in ("s3://", "s3:///prefix"):
        _refused([cmd, "--store", url], url, "names no bucket", "s3://bucket/prefix")


@pytest.mark.parametrize("cmd", ["run", "sql"])
def test_a_file_is_not_a_store(tmp_path, cmd):
    f = tmp_path / "a-file"
    f.write_text("not a store\n")
    _refused([cmd, "--store", str(f)], str(f), "is a file, not a store directory")
    assert f.read_text() == "not a store\n"


def test_a_run_refuses_a_memory_store_at_once(tmp_path):
    _refused(["run", "--store", "memory://x"], "store='memory://x'", "other processes", "directory")


def test_s3_without_credentials(tmp_path, free_port):
    with moto_s3(free_port(), buckets=("bkt",)) as server:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
            and k != "AWS_PROFILE"
        }
        env.update(
            AWS_ENDPOINT_URL=server.endpoint,
            AWS_DEFAULT_REGION="us-east-1",
            AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-credentials"),
            AWS_CONFIG_FILE=str(tmp_path / "no-config"),
            AWS_EC2_METADATA_DISABLED="true",  # no instance to ask, and no wait for one
        )
        for cmd in ("run", "sql"):
            _refused(
                [cmd, "--store", "s3://bkt/runs"],
                "s3://bkt/runs",
                "no AWS credentials",
                "AWS_ACCESS_KEY_ID",
                env=env,
            )
