"""Shared test set-up: offline, quiet, one Prefect test harness per session."""

from __future__ import annotations

import os
import socket

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
os.environ.setdefault("TQDM_DISABLE", "1")  # tqdm reads TQDM_* defaults


@pytest.fixture(scope="session")
def prefect_harness():
    """Prefect's test harness (a temporary API + database), once per session: ~12 s."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def free_port():
    """A function returning a free loopback TCP port."""
    return _free_port
