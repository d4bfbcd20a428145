"""Run untrusted agent code (and the tests that judge it) with limits, in a workspace.

``run(argv, workspace, limits)`` runs one command and returns its exit status and the tail of
its output. Two isolation levels, chosen once per process (``isolation="auto"`` probes):

``namespaces`` (Linux; root, or an unprivileged user namespace), the default where it works:

- **filesystem**: the command sees a new root built from read-only bind mounts of the system
  libraries and the Python installation only, the workspace read-write at ``/workspace``, a
  private size-limited ``/tmp`` and ``/dev/{null,zero,random,urandom}``; the old root is
  detached (``pivot_root``). No other host path exists for it: not the gyre source (hidden
  tests), not the store, not ``$HOME``. Writes land in the workspace or the private ``/tmp``
  (gone when the command ends) or fail.
- **network**: a new network namespace with a loopback that is down: no connection to the
  gateway, the host or the internet, no abstract unix sockets of the host.
- **processes**: a new PID namespace (the command cannot see or signal host processes; when it
  exits or is killed, everything it started dies with it), ``RLIMIT_NPROC`` (a fork bomb
  stops at the limit), privileges dropped (an unprivileged uid, or a nested user namespace so
  exec clears every capability) and ``no_new_privs`` (setuid binaries do not elevate).
- **resources**: ``RLIMIT_AS`` (memory), ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_FSIZE``
  (largest file), ``RLIMIT_NOFILE``, no core dumps, a wall-clock timeout that kills the whole
  namespace, and output read back only up to ``max_output`` bytes.
- **environment**: scrubbed (``PATH``, ``HOME=/tmp``, ``TMPDIR``, ``LANG`` only), stdin empty.

Not guaranteed: a disk quota on the workspace itself (``RLIMIT_FSIZE`` caps each file, not
their number); CPU *share* (no cgroup: a command may use every core until its CPU limit);
kernel exploits; results of code judged in the same process as the tests (code under test can
tamper with the test runner; see tasks/env/repo.py for what the evaluator does about it).

``rlimits`` (fallback where namespaces are refused, e.g. a container without ``unshare``):
resource limits, a scrubbed environment, cwd in the workspace, a new session, an unprivileged
uid when started as root (only where that uid can execute the interpreter: not for a Python
under ``/root``), and for Python code a ``sys.addaudithook`` guard refusing writes
outside the workspace, sockets, subprocesses and ``ctypes``. An audit hook is *not* a security
boundary (code can reach the OS through C extensions already loaded); it stops accidents and
naive escapes only, and a root-less fallback has no ``RLIMIT_NPROC`` protection beyond the
user's own limit. ``isolation="namespaces"`` refuses to fall back.

Pure module apart from the subprocess it starts: no prefect, no distributed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

Isolation = Literal["auto", "namespaces", "rlimits"]

_INIT = str(Path(__file__).with_name("sandbox_init.py"))
SETUP_FAILED = 125


class SandboxError(RuntimeError):
    """The sandbox cannot run here as asked (e.g. namespaces refused and no fallback allowed)."""


@dataclass(frozen=True)
class Limits:
    """Per-command limits. ``cpu_s`` is CPU time per process, ``wall_s`` the whole command."""

    wall_s: float = 30.0
    cpu_s: int = 20
    memory_mb: int = 1024  # address space (RLIMIT_AS) per process
    nproc: int = 32  # processes of the sandbox's user
    fsize_mb: int = 8  # largest file a process may write
    nofile: int = 256
    tmp_mb: int = 32  # the private /tmp
    max_output: int = 64_000  # bytes of stdout / stderr read back (the tail)


@dataclass(frozen=True)
class RunResult:
    returncode: int  # 128 + N when signal N ended it; 125 when the sandbox failed to start
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float
    isolation: str  # namespaces | rlimits

    @property
    def signal(self) -> int | None:
        return self.returncode - 128 if self.returncode > 128 else None


def _python_paths() -> list[str]:
    """Directories the sandboxed Python needs: its installation, its venv, its symlink chain."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    exe = Path(sys.executable)
    while exe.is_symlink():
        paths.add(str(exe.parent))
        target = Path(os.readlink(exe))
        exe = target if target.is_absolute() else exe.parent / target
    paths.add(str(exe.parent))
    out: list[str] = []
    for p in sorted(paths, key=len):  # drop paths inside another one
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return out


SYSTEM_PATHS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", "/etc/ld.so.cache")


def sandbox_env() -> dict[str, str]:
    """The whole environment a sandboxed command gets."""
    return {
        "PATH": f"{Path(sys.prefix) / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "USER": "sandbox",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
    }


_counter = 0


def _sandbox_ids() -> tuple[int, int]:
    """An unprivileged uid/gid for a root caller, distinct per command (RLIMIT_NPROC counts
    per uid, so concurrent sandboxes must not share one)."""
    global _counter
    _counter += 1
    uid = 200_000 + (os.getpid() * 131 + _counter + random.randrange(1 << 16)) % 60_000
    return uid, uid


def _chown_tree(path: str, uid: int, gid: int) -> None:
    os.chown(path, uid, gid)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, gid, follow_symlinks=False)


def _tail(path: str, n: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - n))
        data = f.read()
    text = data.decode("utf-8", "replace")
    return ("[... output truncated ...]\n" + text) if size > n else text


def _wait(proc: subprocess.Popen, wall_s: float) -> bool:
    """Wait up to ``wall_s``; then stop the command. True when it had to be stopped.

    SIGTERM first: the namespace's outer process answers it by killing its PID 1 and reaping
    it (so no zombie is left to the host's init); SIGKILL to the process group if it does not
    exit within a few seconds (its PID 1 then dies by PDEATHSIG)."""
    try:
        proc.wait(timeout=wall_s)
        return False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return True


@dataclass(frozen=True)
class _Job:
    argv: list[str]
    workspace: str
    limits: Limits
    env: dict[str, str]
    extra_ro: tuple[str, ...]
    hide: tuple[str, ...]


def _run_namespaces(job: _Job, out: str, err: str):
    root = tempfile.mkdtemp(prefix="gyre-sandbox-root-")
    limits, workspace = job.limits, job.workspace
    spec = {
        "argv": job.argv,
        "env": job.env,
        "workspace": workspace,
        "root": root,
        "ro_paths": [*SYSTEM_PATHS, *_python_paths(), *job.extra_ro],
        "hide": list(job.hide),
        "tmp_mb": limits.tmp_mb,
        "limits": asdict(limits),
    }
    if os.getuid() == 0:
        spec["uid"], spec["gid"] = _sandbox_ids()
        _chown_tree(workspace, spec["uid"], spec["gid"])
    try:
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", _INIT, json.dumps(spec)],
                stdin=subprocess.DEVNULL,
                stdout=fo,
                stderr=fe,
                env={},
                cwd="/",
                start_new_session=True,
            )
            timed_out = _wait(proc, limits.wall_s)
        rc = proc.returncode
        return (128 - rc if rc < 0 else rc), timed_out
    finally:
        try:
            os.rmdir(root)
        except OSError:
            log.warning("sandbox root %s not removed", root)


_AUDIT_GUARD = r"""
import os as _os, sys as _sys
def _gyre_guard():
    ws = _os.path.realpath(_os.getcwd())
    allowed = (ws, _os.path.realpath(_os.environ.get("TMPDIR", ws)))
    blocked = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
               "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
               "subprocess.Popen", "pty.spawn", "ctypes.dlopen", "ctypes.cdata",
               "ctypes.dlsym", "sys.addaudithook", "os.kill", "os.killpg"}
    writers = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link",
               "os.chmod", "os.chown", "os.truncate", "os.utime", "shutil.rmtree"}
    def inside(p):
        try:
            p = _os.path.realpath(_os.fsdecode(p))
        except (TypeError, ValueError):
            return False
        return any(p == a or p.startswith(a + _os.sep) for a in allowed)
    hidden = HIDDEN_PATHS
    def hook(event, args):
        if event in blocked:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and args and isinstance(args[0], (str, bytes)):
            p = _os.path.realpath(_os.fsdecode(args[0]))
            if any(p == h or p.startswith(h + _os.sep) for h in hidden):
                raise PermissionError(f"sandbox: {args[0]!r} is hidden")
            mode, flags = args[1], args[2]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (_os.O_WRONLY | _os.O_RDWR | _os.O_CREAT))
            if writing and p != _os.devnull and not inside(args[0]):
                raise PermissionError(f"sandbox: writing {args[0]!r} is not allowed")
        elif event in writers and args and isinstance(args[0], (str, bytes)):
            if not all(inside(a) for a in args[:2] if isinstance(a, (str, bytes))):
                raise PermissionError(f"sandbox: {event} outside the workspace")
    _sys.addaudithook(hook)
_gyre_guard(); del _gyre_guard
"""


def _rlimits_preexec(limits: Limits, ids: tuple[int, int] | None):
    mb = 1024 * 1024

    def preexec() -> None:  # runs in the child between fork and exec
        os.setsid()
        if ids is not None:
            os.setgroups([])
            os.setresgid(ids[1], ids[1], ids[1])
            os.setresuid(ids[0], ids[0], ids[0])
        for res, value in (
            (resource.RLIMIT_AS, limits.memory_mb * mb),
            (resource.RLIMIT_CPU, limits.cpu_s),
            (resource.RLIMIT_NPROC, limits.nproc),
            (resource.RLIMIT_FSIZE, limits.fsize_mb * mb),
            (resource.RLIMIT_NOFILE, limits.nofile),
            (resource.RLIMIT_CORE, 0),
        ):
            resource.setrlimit(res, (value, value))

    return preexec


def _others_can_run(path: str) -> bool:
    """Can a uid that owns nothing execute ``path`` (every directory on the way searchable)?"""
    real = os.path.realpath(path)
    parts = Path(real).parents
    return all(os.stat(p).st_mode & 0o001 for p in parts) and bool(os.stat(real).st_mode & 0o001)


def _run_rlimits(job: _Job, out: str, err: str):
    limits, workspace = job.limits, job.workspace
    ids = None
    if os.getuid() == 0:
        if _others_can_run(job.argv[0]):
            ids = _sandbox_ids()
        else:  # e.g. Python installed under /root: an unprivileged uid could not start it
            log.warning(
                "sandbox (rlimits): %s is not executable by others; running as root", job.argv[0]
            )
    if ids is not None:
        _chown_tree(workspace, *ids)
    env = {**job.env, "HOME": workspace, "TMPDIR": workspace}
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen(
            job.argv,
            stdin=subprocess.DEVNULL,
            stdout=fo,
            stderr=fe,
            env=env,
            cwd=workspace,
            preexec_fn=_rlimits_preexec(limits, ids),
        )
        timed_out = _wait(proc, limits.wall_s)
    rc = proc.returncode
    return (128 - rc if rc < 0 else rc), timed_out


@functools.cache
def _probe() -> str | None:
    """None when namespaces work here, else why not."""
    ws = tempfile.mkdtemp(prefix="gyre-sandbox-probe-")
    out, err = os.path.join(ws, ".out"), os.path.join(ws, ".err")
    try:
        inner = tempfile.mkdtemp(dir=ws)
        job = _Job([sys.executable, "-I", "-S", "-c", "pass"], inner, Limits(wall_s=60), {}, (), ())
        rc, _ = _run_namespaces(job, out, err)
        if rc == 0:
            return None
        return _tail(err, 2000).strip() or f"exit status {rc}"
    except OSError as exc:
        return str(exc)
    finally:
        shutil.rmtree(ws, ignore_errors=True)


def resolve_isolation(isolation: Isolation = "auto") -> str:
    """The isolation level ``run`` will use: namespaces where they work, else rlimits."""
    if isolation == "rlimits":
        return "rlimits"
    why = _probe() if sys.platform == "linux" else f"not Linux ({sys.platform})"
    if why is None:
        return "namespaces"
    if isolation == "namespaces":
        raise SandboxError(
            f"Linux namespaces are not available here ({why}); allow unprivileged user "
            "namespaces (sysctl kernel.unprivileged_userns_clone=1 / "
            "user.max_user_namespaces) or use isolation='rlimits' (weaker, see tasks/env/sandbox.py)"
        )
    log.warning("sandbox: namespaces unavailable (%s); falling back to rlimits + audit hook", why)
    return "rlimits"


def run(
    argv: list[str],
    workspace: str | os.PathLike,
    limits: Limits = Limits(),
    *,
    isolation: Isolation = "auto",
    env: Mapping[str, str] | None = None,
    extra_ro: tuple[str, ...] | list[str] = (),
    hide: tuple[str, ...] | list[str] = (),
) -> RunResult:
    """Run ``argv`` in ``workspace`` (cwd) under ``limits``; never raises for the command's
    own failures (they are in the result). With namespaces the workspace is ``/workspace``
    inside, and ``argv[0]`` must be an absolute path that exists inside (the Python running
    gyre, or a system binary).

    ``env``: variables added to the scrubbed environment. ``extra_ro``: more host paths to
    show read-only. ``hide``: paths masked by an empty read-only directory even when a
    shown path contains them (e.g. hidden tests inside an installed package)."""
    ws = os.path.realpath(workspace)
    if not os.path.isdir(ws):
        raise SandboxError(f"workspace {ws!r} is not a directory")
    level = resolve_isolation(isolation)
    job = _Job(
        list(argv),
        ws,
        limits,
        {**sandbox_env(), **(env or {})},
        tuple(os.path.realpath(p) for p in extra_ro),
        tuple(os.path.realpath(p) for p in hide),
    )
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gyre-sandbox-out-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        if level == "namespaces":
            rc, timed_out = _run_namespaces(job, out, err)
        else:
            rc, timed_out = _run_rlimits(job, out, err)
        return RunResult(
            returncode=rc,
            stdout=_tail(out, limits.max_output),
            stderr=_tail(err, limits.max_output),
            timed_out=timed_out,
            wall_s=time.monotonic() - t0,
            isolation=level,
        )


def run_python(
    code: str,
    args: list[str] | tuple[str, ...] = (),
    *,
    workspace: str | os.PathLike,
    limits: Limits = Limits(),
    isolation: Isolation = "auto",
    env: Mapping[str, str] | None = None,
    extra_ro: tuple[str, ...] | list[str] = (),
    hide: tuple[str, ...] | list[str] = (),
) -> RunResult:
    """Run Python ``code`` (``python -I -B -c code *args``) in the sandbox. The workspace is
    the cwd; ``-I`` keeps it off ``sys.path``, so code that imports the workspace's modules
    inserts ``os.getcwd()`` itself. Under ``rlimits`` the audit-hook guard is prepended
    (it also refuses to open anything under ``hide``)."""
    level = resolve_isolation(isolation)
    if level == "rlimits":
        hidden = [os.path.realpath(p) for p in hide]
        code = _AUDIT_GUARD.replace("HIDDEN_PATHS", repr(hidden)) + "\n" + code
    return run(
        [sys.executable, "-I", "-B", "-c", code, *args],
        workspace,
        limits,
        isolation=level,
        env=env,
        extra_ro=extra_ro,
        hide=hide,
    )
