"""Checkpoint cache on an object store (storage/checkpoints.py `fetch_checkpoint`): several
processes fetching the same version at once all load it; none deletes the directory
another is reading (a clean-clone `make test` once failed with `failed to load .../v0`)."""

from __future__ import annotations

import os
import threading
import time

from storage.checkpoints import fetch_checkpoint, publish_checkpoint
from storage.store import Store
from tests.s3 import moto_s3

FILES = {f"shard-{i}.bin": bytes([i]) * 50_000 for i in range(6)}


def _load(path: str, seconds: float) -> None:
    """What an engine does with the directory: read every file, for a while."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for name, data in FILES.items():
            with open(os.path.join(path, name), "rb") as fh:
                assert fh.read() == data


def _fetch_all_at_once(st: Store, cache: str, n: int) -> tuple[list[str], list[BaseException]]:
    """``n`` threads fetch version 0 into one cache at once, then load it."""
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []
    paths: list[str] = []

    def one() -> None:
        try:
            barrier.wait()
            path = fetch_checkpoint(st, "r", 0, cache_dir=cache)
            paths.append(path)
            _load(path, 0.5)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return paths, errors


def test_concurrent_fetches_of_one_version_all_load(tmp_path, free_port):
    src = tmp_path / "ck"
    src.mkdir()
    for name, data in FILES.items():
        (src / name).write_bytes(data)
    with moto_s3(free_port(), ("ckpts",)):
        st = Store("s3://ckpts/store", retry_s=10)
        publish_checkpoint(st, "r", str(src), 0)
        for it in range(8):
            paths, errors = _fetch_all_at_once(st, str(tmp_path / f"cache{it}"), 4)
            assert not errors, f"iteration {it}: {errors[0]!r}"
            assert len(set(paths)) == 1
            # the losers' copies are gone; only the version's directory is left
            assert os.listdir(os.path.dirname(paths[0])) == ["v0"]
