"""Hosts for tests: Linux network namespaces on a bridge, one veth pair each (needs root).

Each namespace is a host with its own network stack (its own loopback and ports), reached
from the others only through its veth on the bridge; ``Hosts.start`` can also hide
directories from a process (a tmpfs over them in a private mount namespace), so a "host"
shares no local disk it should not. Names and the subnet are unique per process (from
the pid) and everything is removed on exit, whatever happened.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path


class NoNamespaces(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``, or not allowed)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def why_not() -> str | None:
    """Why this process cannot make namespaces, or None."""
    if os.geteuid() != 0:
        return "needs root (ip netns, a bridge, veth pairs)"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs iproute2's `ip` and util-linux's `unshare`"
    probe = f"gyreprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` is not allowed here: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Hosts:
    """``names`` namespaces on one bridge, addresses 10.213.X.1, .2, ... in a /24 whose X
    comes from the pid; the bridge itself (this process's side) is 10.213.X.254."""

    def __init__(self, names: Sequence[str]):
        tag = os.getpid() % 100_000
        self.tag = tag
        self.subnet = f"10.213.{tag % 250}"
        self.bridge = f"gbr{tag}"
        self.ns = {n: f"gyre{tag}-{n}" for n in names}
        self.veth = {n: f"gv{tag}{i}" for i, n in enumerate(names)}  # the bridge's side
        self.addr = {n: f"{self.subnet}.{i + 1}" for i, n in enumerate(names)}
        self.me = f"{self.subnet}.254"
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> Hosts:
        try:
            _ip("link", "add", "name", self.bridge, "type", "bridge")
            # bridged frames skip iptables where br_netfilter is loaded (a FORWARD DROP policy)
            _ip("link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0", check=False)
            _ip("addr", "add", f"{self.me}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for n, ns in self.ns.items():
                _ip("netns", "add", ns)
                _ip(
                    "link", "add", self.veth[n], "type", "veth", "peer", "name", "eth0", "netns", ns
                )
                _ip("link", "set", self.veth[n], "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.addr[n]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for p in reversed(self._procs):
            _kill(p)
        for ns in self.ns.values():
            _ip("netns", "del", ns, check=False)  # takes its end of the veth with it
        for v in self.veth.values():
            _ip("link", "del", v, check=False)
        _ip("link", "del", self.bridge, check=False)

    def start(
        self,
        host: str,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        log: Path,
        hide: Sequence[str] = (),
    ) -> subprocess.Popen:
        """Run ``argv`` on ``host`` (its own process group, stopped on exit); ``hide``:
        directories it must not see (an empty tmpfs over each)."""
        cmd = ["ip", "netns", "exec", self.ns[host]]
        if hide:
            mounts = " && ".join(f'mount -t tmpfs tmpfs "{d}"' for d in hide)
            cmd += ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    f'{mounts} && exec "$@"', "sh"]  # fmt: skip
        p = subprocess.Popen(
            [*cmd, *argv],
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._procs.append(p)
        return p

    def run(self, host: str, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns[host], *argv], **kw)

    def link(self, host: str, up: bool) -> None:
        """Take a host's link down (as a pulled cable: no reset reaches anyone) or up."""
        _ip("link", "set", self.veth[host], "up" if up else "down")

    def counters(self, host: str) -> dict[str, int]:
        """Bytes through a host's link, as the bridge side counts them: ``sent`` by the
        host, ``received`` by it (frames on the wire, headers included)."""
        stats = json.loads(_ip("-s", "-j", "link", "show", self.veth[host]).stdout)[0]["stats64"]
        return {"sent": stats["rx"]["bytes"], "received": stats["tx"]["bytes"]}


def _kill(p: subprocess.Popen) -> None:
    import signal

    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=20)
    except (ProcessLookupError, PermissionError):
        return
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


def wait_for(what: str, ok, timeout: float, logs: Sequence[Path] = (), every: float = 0.5):
    """Poll ``ok()`` until it is truthy (its value) or ``timeout`` passes (an AssertionError
    with the tails of ``logs``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = ok()
        except Exception:
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.exists())
            raise AssertionError(f"{what}: not within {timeout:.0f}s\n{tails}")
        time.sleep(every)
