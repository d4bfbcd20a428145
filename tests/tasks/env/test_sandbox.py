"""Escape attempts against the sandbox, as real processes (tasks/env/sandbox.py).

Each test runs hostile Python in a fresh workspace and checks the host afterwards: files
outside the workspace, a listening socket, the process table, the clock.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from tasks.env import sandbox
from tasks.env.sandbox import Limits, run_python

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is Linux-only")

NS = "namespaces"
SLOW_RLIMITS = pytest.param("rlimits", marks=pytest.mark.slow)  # the weaker fallback: opt-in
REPO = Path(__file__).resolve().parents[3]
HIDDEN = REPO / "tasks" / "env" / "repo_specs" / "roman" / "hidden"


def _ns_available() -> bool:
    try:
        return sandbox.resolve_isolation("auto") == NS
    except sandbox.SandboxError:
        return False


needs_ns = pytest.mark.skipif(not _ns_available(), reason="no Linux namespaces here")
LEVELS = [pytest.param(NS, marks=needs_ns), "rlimits"]


@pytest.fixture
def ws(tmp_path):
    d = tmp_path / "ws"
    d.mkdir()
    return d


def _py(code: str, ws: Path, isolation: str, **kw) -> sandbox.RunResult:
    return run_python(textwrap.dedent(code), workspace=ws, isolation=isolation, **kw)


@pytest.mark.parametrize("isolation", LEVELS)
def test_workspace_is_writable_and_the_environment_scrubbed(ws, isolation, monkeypatch):
    monkeypatch.setenv("GYRE_SECRET", "s3cret")
    r = _py(
        """
        import os
        open("out.txt", "w").write("ok")
        print(sorted(os.environ))
        """,
        ws,
        isolation,
    )
    assert r.returncode == 0, r.stderr
    assert (ws / "out.txt").read_text() == "ok"
    assert "GYRE_SECRET" not in r.stdout and "HOME" in r.stdout
    assert r.isolation == isolation


@pytest.mark.parametrize("isolation", LEVELS)
def test_cannot_write_outside_the_workspace(ws, tmp_path, isolation):
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "pwned.txt"
    host_tmp = Path(f"/tmp/gyre-pwned-{uuid.uuid4().hex}")
    r = _py(
        f"""
        import os, sys
        errors = 0
        for path in ({str(target)!r}, {str(REPO / "PWNED")!r}, {str(host_tmp)!r},
                     "../escaped.txt"):
            try:
                with open(path, "w") as f:
                    f.write("x")
            except OSError as exc:
                errors += 1
        print("errors", errors)
        """,
        ws,
        isolation,
    )
    assert not target.exists() and not (REPO / "PWNED").exists()
    assert not (tmp_path / "escaped.txt").exists()
    if isolation == NS:  # /tmp is private (and vanishes); the rest does not exist or is read-only
        assert not host_tmp.exists()
        assert "errors 3" in r.stdout, r.stdout + r.stderr
    else:  # the audit hook refuses all four
        assert "errors 4" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("isolation", LEVELS)
def test_no_network(ws, isolation):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list = []
    done = threading.Event()

    def accept():
        while not done.is_set():
            try:
                accepted.append(server.accept())
                return
            except TimeoutError:
                continue

    t = threading.Thread(target=accept)
    t.start()
    r = _py(
        f"""
        import socket
        for target in (("127.0.0.1", {port}), ("1.1.1.1", 80)):
            try:
                socket.create_connection(target, timeout=2)
                print("connected", target)
            except OSError as exc:
                print("refused", type(exc).__name__)
        """,
        ws,
        isolation,
        limits=Limits(wall_s=15),
    )
    time.sleep(0.3)  # a connection that got through would be accepted by now
    done.set()
    t.join()
    server.close()
    assert accepted == [] and "connected" not in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("refused") == 2 or "sandbox:" in r.stderr


def _procs_in_namespace(ns: str) -> int:
    """Host processes whose PID namespace is ``ns`` (e.g. 'pid:[4026532001]')."""
    n = 0
    for p in Path("/proc").iterdir():
        try:
            n += p.name.isdigit() and os.readlink(p / "ns" / "pid") == ns
        except OSError:
            continue
    return n


@needs_ns
def test_fork_bomb_is_contained_and_cleaned_up(ws):
    t0 = time.monotonic()
    r = _py(
        """
        import os, time
        print(os.readlink("/proc/self/ns/pid"), flush=True)
        n = 0
        for _ in range(10_000):
            try:
                if os.fork() == 0:
                    time.sleep(60)  # children linger: only the sandbox can reap them
                    os._exit(0)
                n += 1
            except OSError:
                break
        print("forked", n, flush=True)
        time.sleep(60)
        """,
        ws,
        NS,
        limits=Limits(wall_s=3, nproc=20),
    )
    assert r.timed_out and time.monotonic() - t0 < 20
    ns, counted = r.stdout.splitlines()[:2]
    assert ns != os.readlink("/proc/self/ns/pid")
    assert int(counted.split()[1]) < 20  # RLIMIT_NPROC stopped it
    time.sleep(0.5)
    assert _procs_in_namespace(ns) == 0  # every process of the sandbox is gone


@needs_ns
def test_background_process_dies_with_the_command(ws):
    r = _py(
        """
        import os, subprocess, sys
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                             start_new_session=True)
        print(os.readlink("/proc/self/ns/pid"))
        """,
        ws,
        NS,
    )
    assert r.returncode == 0, r.stderr
    time.sleep(0.3)
    assert _procs_in_namespace(r.stdout.strip()) == 0


@pytest.mark.parametrize("isolation", [LEVELS[0], SLOW_RLIMITS])
def test_runaway_cpu_is_stopped(ws, isolation):
    t0 = time.monotonic()
    r = _py("while True: pass", ws, isolation, limits=Limits(wall_s=20, cpu_s=1))
    assert time.monotonic() - t0 < 15
    assert r.returncode != 0 and not r.timed_out  # RLIMIT_CPU, not the wall clock


@pytest.mark.parametrize("isolation", [LEVELS[0], SLOW_RLIMITS])
def test_runaway_wall_clock_is_stopped(ws, isolation):
    t0 = time.monotonic()
    r = _py("import time; time.sleep(120)", ws, isolation, limits=Limits(wall_s=2))
    assert r.timed_out and time.monotonic() - t0 < 10


@pytest.mark.parametrize("isolation", LEVELS)
def test_huge_memory_is_refused(ws, isolation):
    r = _py(
        """
        try:
            block = bytearray(8 * 1024**3)
            print("allocated")
        except MemoryError:
            print("refused")
        """,
        ws,
        isolation,
        limits=Limits(memory_mb=512),
    )
    assert "allocated" not in r.stdout and "refused" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("isolation", LEVELS)
def test_huge_file_is_refused(ws, isolation):
    r = _py(
        """
        with open("big.bin", "wb") as f:
            for _ in range(64):
                f.write(b"x" * 1024 * 1024)
        """,
        ws,
        isolation,
        limits=Limits(fsize_mb=4),
    )
    assert r.returncode != 0 and (ws / "big.bin").stat().st_size <= 4 * 1024 * 1024


@pytest.mark.parametrize("isolation", LEVELS)
def test_hidden_tests_are_not_readable(ws, isolation):
    hidden = HIDDEN / "test_errors.py"
    visible = REPO / "tasks" / "env" / "repo_specs" / "roman" / "spec.md"
    code = f"""
        for path in ({str(hidden)!r}, {str(visible)!r}):
            try:
                open(path).read()
                print("read", path)
            except OSError as exc:
                print("denied", type(exc).__name__)
        """
    # even with the whole repository shown read-only, the hidden directory is masked
    r = _py(code, ws, isolation, extra_ro=[str(REPO)], hide=[str(HIDDEN.parent.parent)])
    assert f"read {hidden}" not in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("denied") == 2
    if isolation == NS:  # without extra_ro the source tree does not exist at all
        r = _py(code, ws, isolation)
        assert r.stdout.count("denied") == 2, r.stdout + r.stderr


@needs_ns
def test_host_processes_are_invisible(ws):
    r = _py(
        """
        import os
        print(sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
        print(os.getuid())
        """,
        ws,
        NS,
    )
    pids = eval(r.stdout.splitlines()[0])
    assert pids and max(pids) < 10  # only the sandbox's own: init (1), the command (2)
    assert int(r.stdout.splitlines()[1]) != 0  # not root inside


@needs_ns
@pytest.mark.skipif(
    os.getuid() != 0 or not (shutil.which("setpriv") and Path("/usr/bin/python3").is_file()),
    reason="checks the unprivileged (user namespace) path from a root test run",
)
def test_unprivileged_caller_gets_the_same_sandbox():
    """As a plain user (uid 65534), the sandbox builds on a user namespace instead."""
    closed = [p for p in (REPO, *REPO.parents) if not p.stat().st_mode & 0o001]
    if closed:  # e.g. a checkout under a 0700 home or mktemp directory
        pytest.skip(
            f"uid 65534 cannot reach the checkout to import gyre ({closed[-1]} is closed to others)"
        )
    top = Path(tempfile.mkdtemp(prefix="gyre-userns-"))  # pytest's tmp_path is private to root
    try:
        _unprivileged(top)
    finally:
        shutil.rmtree(top)


def _unprivileged(top: Path) -> None:
    ws, mine = top / "ws", top / "mine"
    for d in (ws, mine):
        d.mkdir()
        os.chown(d, 65534, 65534)
    os.chown(top, 65534, 65534)
    outside = mine / "outside.txt"  # the calling user may write here; its sandbox may not
    hostile = "\n".join(
        [
            "import os, socket",
            "try:",
            f"    open({str(outside)!r}, 'w').write('x')",
            "except OSError:",
            "    print('write denied')",
            "try:",
            "    socket.create_connection(('127.0.0.1', 22), timeout=1)",
            "except OSError:",
            "    print('net denied')",
        ]
    )
    script = (
        "from tasks.env import sandbox\n"
        f"r = sandbox.run_python({hostile!r}, workspace={str(ws)!r}, isolation='namespaces')\n"
        "print(r.isolation, r.returncode)\n"
        "print(r.stdout, r.stderr)\n"
    )
    out = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
         "-c", script],
        env={"PYTHONPATH": str(REPO), "HOME": str(top), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "namespaces 0" in out.stdout, out.stdout
    assert "write denied" in out.stdout and "net denied" in out.stdout
    assert not outside.exists()
