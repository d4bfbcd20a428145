"""The sandbox's first process: namespaces, a minimal read-only root, limits, then the command.

Run by `tasks.env.sandbox` as ``python -I -S -B sandbox_init.py SPEC_JSON`` (standard library
only: it must work before any site-packages exist in its view). What it does, in order:

1. ``unshare`` new mount, PID, network, IPC and UTS namespaces. Not root: a user namespace
   too, mapping the caller's uid/gid to root inside (so the mounts below are permitted).
2. fork: the child is PID 1 of the new PID namespace (it dies with this process: PDEATHSIG).
3. PID 1 builds a new root on a tmpfs: read-only bind mounts of the allow-listed host paths
   (system libraries, the Python installation), the workspace read-write at ``/workspace``, a
   size-limited tmpfs at ``/tmp``, a fresh ``/proc``, and ``/dev/{null,zero,random,urandom}``;
   then ``pivot_root`` into it and detaches the old root, so nothing else of the host is
   reachable by path. The network namespace has only a loopback that is down.
4. PID 1 forks the command as PID 2 with privileges dropped (root caller: an unprivileged
   uid/gid, no groups; otherwise a nested user namespace whose uid is not 0, so that exec
   clears every capability), ``no_new_privs``, the resource limits and a scrubbed
   environment, then waits. When the command exits PID 1 exits, and the kernel kills
   whatever the command left running in the namespace.

Exit status: the command's, or 128 + signal when a signal ended it; 125 when the sandbox
could not be set up (the reason is on stderr, prefixed ``sandbox:``).
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MNT_DETACH = 2

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38

SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41}

SETUP_FAILED = 125

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(RuntimeError):
    pass


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def _unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None):
    enc = [None if s is None else s.encode() for s in (src, target, fstype, data)]
    _check(
        _libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]),
        f"mount {src} -> {target}",
    )


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _map_ids(inner: int, outer_uid: int, outer_gid: int) -> None:
    """Map one uid/gid of this (new) user namespace onto our own (no privilege needed)."""
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{inner} {outer_uid} 1\n")
    _write("/proc/self/gid_map", f"{inner} {outer_gid} 1\n")


def _locked_flags(path: str) -> int:
    """Mount flags a remount of ``path`` must keep (a user namespace may not clear them)."""
    f = os.statvfs(path).f_flag
    out = 0
    for st, ms in (
        (os.ST_NOSUID, MS_NOSUID),
        (os.ST_NODEV, MS_NODEV),
        (os.ST_NOEXEC, MS_NOEXEC),
        (os.ST_NOATIME, MS_NOATIME),
        (os.ST_NODIRATIME, MS_NODIRATIME),
        (os.ST_RELATIME, MS_RELATIME),
    ):
        if f & st:
            out |= ms
    return out


def _bind(src: str, dst: str, *, readonly: bool) -> None:
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if not os.path.exists(dst):
            open(dst, "w").close()
    _mount(src, dst, None, MS_BIND)
    if readonly:
        _mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _locked_flags(dst))


def _build_root(spec: dict) -> None:
    """Populate the new root (a tmpfs at spec['root']) and pivot into it."""
    root = spec["root"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount leaks to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    # /tmp first: an allow-listed path under /tmp (a project or venv checked out there) is
    # bound on top of it, not hidden by it
    os.makedirs(root + "/tmp")
    _mount(
        "tmpfs",
        root + "/tmp",
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={spec['tmp_mb']}m,mode=1777",
    )
    for path in spec["ro_paths"]:
        if os.path.islink(path):  # e.g. /lib -> usr/lib on merged-/usr systems
            dst = root + path
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.symlink(os.readlink(path), dst)
        elif os.path.exists(path):
            _bind(path, root + path, readonly=True)
    for path in spec["hide"]:  # e.g. hidden tests inside a shown installation
        if os.path.isdir(root + path):
            _mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k")
        elif os.path.exists(root + path):
            _mount("/dev/null", root + path, None, MS_BIND)
    for dev in ("null", "zero", "random", "urandom"):
        _bind(f"/dev/{dev}", f"{root}/dev/{dev}", readonly=False)
    _bind(spec["workspace"], root + "/workspace", readonly=False)
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/.old")
    nr = SYS_PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise SetupError(f"pivot_root: unknown syscall number on {platform.machine()}")
    _check(_libc.syscall(nr, root.encode(), (root + "/.old").encode()), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old", MNT_DETACH), "umount old root")
    os.rmdir("/.old")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _drop_privileges(spec: dict, userns: bool) -> None:
    if userns:
        # a nested user namespace where we are not root: exec then clears all capabilities,
        # and the mounts above (owned by the parent namespace) cannot be changed from here
        _unshare(CLONE_NEWUSER)
        _map_ids(1000, 0, 0)
    else:
        uid, gid = spec["uid"], spec["gid"]
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _set_limits(lim: dict) -> None:
    mb = 1024 * 1024
    for res, value in (
        (resource.RLIMIT_AS, lim["memory_mb"] * mb),
        (resource.RLIMIT_CPU, lim["cpu_s"]),
        (resource.RLIMIT_NPROC, lim["nproc"]),
        (resource.RLIMIT_FSIZE, lim["fsize_mb"] * mb),
        (resource.RLIMIT_NOFILE, lim["nofile"]),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(res, (value, value))


def _command(spec: dict, userns: bool, err_fd: int) -> None:
    """PID 2: drop privileges, limit, exec. Never returns."""
    try:
        os.chdir("/workspace")
        _drop_privileges(spec, userns)
        _set_limits(spec["limits"])
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as exc:
        os.write(err_fd, f"sandbox: {exc}\n".encode())
    os._exit(SETUP_FAILED)


def _status(st: int) -> int:
    if os.WIFSIGNALED(st):
        return 128 + os.WTERMSIG(st)
    return os.WEXITSTATUS(st)


def _pid1(spec: dict, userns: bool) -> None:
    """PID 1 of the namespace: build the root, run the command, reap, exit with its status."""
    err = sys.stderr.fileno()
    try:
        # dies with the outer process (which the caller kills on a wall-clock timeout)
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
        _build_root(spec)
        _check(_libc.sethostname(b"sandbox", 7), "sethostname")
    except BaseException as exc:
        os.write(err, f"sandbox: {exc}\n".encode())
        os._exit(SETUP_FAILED)
    child = os.fork()
    if child == 0:
        _command(spec, userns, err)
    while True:  # as PID 1, reap every orphan until the command itself is done
        pid, st = os.wait()
        if pid == child:
            os._exit(_status(st))


def main() -> None:
    spec = json.loads(sys.argv[1])
    userns = os.getuid() != 0
    try:
        flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
        uid, gid = os.getuid(), os.getgid()
        _unshare(flags | (CLONE_NEWUSER if userns else 0))
        if userns:
            _map_ids(0, uid, gid)
    except BaseException as exc:
        sys.stderr.write(f"sandbox: {exc}\n")
        sys.exit(SETUP_FAILED)
    pid = os.fork()
    if pid == 0:
        _pid1(spec, userns)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))
    _, st = os.waitpid(pid, 0)
    sys.exit(_status(st))


if __name__ == "__main__":
    main()
