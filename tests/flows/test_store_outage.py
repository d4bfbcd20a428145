"""A run whose S3 store goes away mid-run and stays away ends within about one bound
(``GYRE_STORE_RETRY_S``) with one clear line, not after two bounds with a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.s3 import moto_s3

pytestmark = [pytest.mark.integration, pytest.mark.fault, pytest.mark.slow]

# the run's ordinary stop (rollouts drain, cells and Prefect end) took 15-65 s here, the
# more the busier the machine: a bound well above it tells one bound from two
BOUND_S = 90


def test_a_run_ends_within_one_bound_when_its_store_goes_away(tmp_path, free_port):
    import boto3

    with moto_s3(free_port(), buckets=("bkt",)) as server:
        env = {**os.environ, "GYRE_STORE_RETRY_S": str(BOUND_S), "GYRE_CACHE": str(tmp_path)}
        log = open(tmp_path / "run.log", "w")  # noqa: SIM115 (the child writes it)
        run = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "run", "--preset", "tiny"]
            + ["--store", "s3://bkt/r", "train.steps=60"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
        s3 = boto3.client("s3", endpoint_url=server.endpoint)
        try:
            while run.poll() is None:  # mid-run: a step is committed
                keys = [o["Key"] for o in s3.list_objects_v2(Bucket="bkt").get("Contents", [])]
                if any(k.startswith("r/steps/") for k in keys):
                    break
                time.sleep(1)
            assert run.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            server.stop()
            t0 = time.monotonic()
            rc = run.wait(timeout=4 * BOUND_S + 120)
            took = time.monotonic() - t0
        finally:
            if run.poll() is None:
                run.kill()
            log.close()
    out = (tmp_path / "run.log").read_text()
    assert rc == 1, out[-3000:]
    # one bound, plus the ordinary stop (rollouts drain, cells and Prefect end); it took
    # two bounds and more before
    assert took < 2 * BOUND_S, (took, out[-3000:])
    last = out.strip().splitlines()[-1]
    assert last.startswith("gyre run: store:") and "--resume" in last, out[-3000:]
    assert "kept failing" in last or "unreachable" in last
