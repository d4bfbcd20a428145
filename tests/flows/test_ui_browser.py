"""The Prefect UI in a real browser: a finished run's pictures load.

A Prefect server with its UI (``prefect server start``) on a free port, a run's artifacts
made against it by the real code (tests/flows/ui_run.py: the parent and sub-flow of a
``gyre run``, without the minutes of training), then headless Chromium (playwright, the distribution's ``chromium``) opens the
run's artifacts and checks that each picture decoded (``naturalWidth > 0``), and that the
artifacts and the progress bar sit on the run a user opens (``rl_run``, not its sub-flow).
Install: ``pip install playwright`` and ``apt-get install chromium`` (``make install``
does both where it can).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip("no chromium on PATH: apt-get install chromium (the UI test needs a browser)")


def _api(url: str, path: str, body: dict | None = None):
    req = urllib.request.Request(
        f"{url}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="GET" if body is None else "POST",
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


@pytest.fixture()
def prefect_ui(tmp_path, free_port):
    """A Prefect server with its UI, its database in tmp_path; yields its base URL."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_UI_API_URL": f"{base}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    env.pop("PREFECT_API_URL", None)
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
           "--port", str(port), "--no-services"]  # fmt: skip
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if _api(base, "/api/health") is True:
                    break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "prefect server did not start in 180 s"
            time.sleep(1)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_finished_runs_pictures_load_in_the_prefect_ui(prefect_ui, tmp_path):
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="pip install playwright (the UI test drives a browser)"
    )
    chromium = _chromium()
    env = {**os.environ, "PREFECT_API_URL": f"{prefect_ui}/api"}
    cmd = [sys.executable, "-m", "tests.flows.ui_run", str(tmp_path / "data"), "ui-run"]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]

    arts = _api(prefect_ui, "/api/artifacts/filter", {"limit": 200})
    by_key = {a["key"]: a for a in arts if a.get("key")}
    runs = _api(prefect_ui, "/api/flow_runs/filter", {"limit": 50})
    (root,) = [r for r in runs if r["parent_task_run_id"] is None]
    for key in ("gyre-cells-ui-run", "gyre-learning-ui-run", "gyre-progress-ui-run"):
        assert key in by_key, sorted(by_key)
        assert by_key[key]["flow_run_id"] == root["id"], key  # the run a user opens
    assert by_key["gyre-progress-ui-run"]["data"] == 100.0

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            for key, alt in (("gyre-cells-ui-run", "role timeline"),
                             ("gyre-learning-ui-run", "learning curve")):  # fmt: skip
                page.goto(f"{prefect_ui}/artifacts/artifact/{by_key[key]['id']}")
                img = page.wait_for_selector(f"img[alt='{alt}']", timeout=90_000)
                page.wait_for_function("i => i.complete", arg=img, timeout=30_000)
                width, height, src = img.evaluate(
                    "i => [i.naturalWidth, i.naturalHeight, i.currentSrc.slice(0, 22)]"
                )
                assert width > 300 and height > 100 and src == "data:image/png;base64,", key
        finally:
            browser.close()
