"""Planted-bug runner: apply each mutant (tests/mutation/mutants.py) alone to a temporary copy
of the code, run the tests it names (``-x``), and report killed / survived.

    PYTHONPATH=$PWD python -m tests.mutation.runner            # all mutants, a table
    PYTHONPATH=$PWD python -m tests.mutation.runner --json out.json --only clip

The copy holds ``flows``, ``tasks``, ``storage``, ``infra``, ``tests`` and ``pyproject.toml`` (no bytecode
is written, so an edited file is never shadowed by a stale ``.pyc``). The runner first checks
that the unmutated copy passes every test subset it will use. Each mutant runs in a child
forked from a parent that has already imported torch, transformers and the other heavy
libraries (but no project module), which saves their import time per mutant; a mutant that
hangs past ``--timeout`` is killed and counts as killed. ``--no-fork`` uses a fresh
interpreter per mutant instead. ``--jobs`` mutants run side by side (default: one per core,
at most 4), each on its own copy with its own pytest ``--basetemp``: every child runs on one
torch thread, so one at a time left all but one core idle (the baseline still runs alone).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutants import MUTANTS, Mutant  # noqa: E402  (a plain file: no project package imported)

COPY = ("flows", "tasks", "storage", "infra", "tests", "pyproject.toml")
PROJECT = ("tasks", "storage", "infra", "flows", "tests")


class MutantError(RuntimeError):
    """A mutant does not apply (its ``old`` text is not in the file exactly once)."""


@dataclass
class Result:
    name: str
    path: str
    status: str  # killed | survived | timeout | baseline
    seconds: float
    rc: int
    failed: str = ""  # the first failing test (what killed it)


def _first_failure(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in lines:
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ")[0].split(" ", 1)[1]
    return ""


def make_copy(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPY:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)
    return dest


def check_applies(m: Mutant) -> None:
    text = (ROOT / m.path).read_text()
    n = text.count(m.old)
    if n != 1:
        raise MutantError(
            f"mutant {m.name!r}: its text occurs {n} times in {m.path} (must be once); the code "
            "moved: update tests/mutation/mutants.py"
        )


def _preimport() -> None:
    """Heavy third-party imports, done once in the parent (never a project module)."""
    import numpy  # noqa: F401
    import pyarrow  # noqa: F401
    import pydantic  # noqa: F401
    import pytest  # noqa: F401
    import torch
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config  # noqa: F401
    from transformers.models.qwen3 import modeling_qwen3  # noqa: F401

    torch.set_num_threads(1)


def _pytest_args(tests: tuple[str, ...], basetemp: Path) -> list[str]:
    return [
        *tests,
        f"--basetemp={basetemp}",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "not slow and not gpu",
        "--no-header",
        "-W",
        "ignore",
    ]


def _fork_pytest(work: Path, tests: tuple[str, ...], log: Path, basetemp: Path) -> int:
    """A child forked from this process (heavy libraries already imported) that imports the
    (mutated) copy and runs pytest; returns its pid."""
    pid = os.fork()
    if pid == 0:  # child: import the (mutated) copy, run pytest, exit with its code
        rc = 3
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.chdir(work)
            sys.dont_write_bytecode = True
            for mod in [m for m in sys.modules if m.split(".")[0] in PROJECT]:
                del sys.modules[mod]
            sys.path[:] = [str(work)] + [p for p in sys.path if p and Path(p) != ROOT]
            import pytest

            rc = int(pytest.main(_pytest_args(tests, basetemp)))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    return pid


class _Run:
    """One pytest run on one copy, started now (forked, or a fresh interpreter when ``fork``
    is false); ``poll()`` is ``(False, None)`` while it runs, then ``(True, exit code)``, or
    ``(True, None)`` when it ran past ``timeout`` and was killed."""

    def __init__(self, work: Path, tests: tuple[str, ...], log: Path, timeout: float, fork: bool):
        self.t0 = time.monotonic()
        self.deadline = self.t0 + timeout
        basetemp = work.parent / f"basetemp-{work.name}"  # its own: runs go side by side
        self.proc: subprocess.Popen | None = None
        self._log = None
        if fork:
            self.pid = _fork_pytest(work, tests, log, basetemp)
        else:
            env = dict(os.environ, PYTHONPATH=str(work), PYTHONDONTWRITEBYTECODE="1")
            self._log = open(log, "w")  # noqa: SIM115 (closed in poll)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", *_pytest_args(tests, basetemp)],
                cwd=work,
                env=env,
                stdout=self._log,
                stderr=subprocess.STDOUT,
            )
            self.pid = self.proc.pid

    def poll(self) -> tuple[bool, int | None]:
        if self.proc is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            rc = os.waitstatus_to_exitcode(status) if done else None
        else:
            rc = self.proc.poll()
        if rc is None and time.monotonic() <= self.deadline:
            return False, None
        if rc is None:  # past its deadline
            self.kill()
        if self._log is not None:
            self._log.close()
        return True, rc

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def default_jobs() -> int:
    """Runs side by side: one per core this process may use (each child runs on one torch
    thread), at most 4 (each holds torch and the test's models)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def run(
    mutants: list[Mutant],
    *,
    fork: bool = True,
    timeout: float = 300.0,
    keep: Path | None = None,
    jobs: int | None = None,
) -> list[Result]:
    """Every mutant, ``jobs`` at a time (default: one per core, :func:`default_jobs`), each
    side-by-side run on its own copy of the code; results in the order of ``mutants``."""
    for m in mutants:
        check_applies(m)
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if fork:
        import torch

        threads = torch.get_num_threads()
        _preimport()
    jobs = jobs or default_jobs()
    tmp = Path(tempfile.mkdtemp(prefix="gyre-mutants-")) if keep is None else keep
    copies = [make_copy(tmp / ("src" if i == 0 else f"src{i}")) for i in range(jobs)]
    logs = tmp / "logs"
    logs.mkdir(exist_ok=True)
    # the unmutated code must pass every test a mutant uses, or a "kill" means nothing
    every = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
    # one run, alone, as before: some of these tests time their own processes (a DP member's
    # failed formation must be over within a sleep), which a second run beside them slows
    t0 = time.monotonic()
    base = _Run(copies[0], every, logs / "baseline.log", timeout, fork)
    while not (got := base.poll())[0]:
        time.sleep(0.05)
    if got[1] != 0:
        raise MutantError(
            f"the unmutated code fails {' '.join(every)} (rc={got[1]}); see {logs / 'baseline.log'}"
        )
    results = [Result(" ".join(every), "", "baseline", time.monotonic() - t0, 0)]
    done: dict[int, Result] = {}
    pending = list(enumerate(mutants))
    free = list(copies)
    active: dict[int, tuple[Path, str, _Run]] = {}  # mutant index -> (copy, its text, run)
    try:
        while pending or active:
            while pending and free:
                i, m = pending.pop(0)
                work = free.pop(0)
                target = work / m.path
                original = target.read_text()
                target.write_text(original.replace(m.old, m.new))
                active[i] = (
                    work,
                    original,
                    _Run(work, m.tests, logs / f"{i:02d}.log", timeout, fork),
                )
            for i, (work, original, r) in list(active.items()):
                finished, rc = r.poll()
                if not finished:
                    continue
                m = mutants[i]
                (work / m.path).write_text(original)
                free.append(work)
                del active[i]
                secs = time.monotonic() - r.t0
                status = "timeout" if rc is None else "survived" if rc == 0 else "killed"
                first = _first_failure(logs / f"{i:02d}.log")
                done[i] = Result(m.name, m.path, status, secs, -1 if rc is None else rc, first)
                print(f"{status:8s} {secs:6.1f}s  {m.path}: {m.name}", flush=True)
            time.sleep(0.05)
    finally:
        for i, (work, original, r) in active.items():
            r.kill()
            (work / mutants[i].path).write_text(original)
    results += [done[i] for i in range(len(mutants))]
    if keep is None:
        shutil.rmtree(tmp, ignore_errors=True)
    if fork:
        torch.set_num_threads(threads)
    return results


def summary(results: list[Result]) -> dict:
    muts = [r for r in results if r.status != "baseline"]
    killed = [r for r in muts if r.status in ("killed", "timeout")]
    return {
        "mutants": len(muts),
        "killed": len(killed),
        "survived": [r.name for r in muts if r.status == "survived"],
        "kill_rate": len(killed) / len(muts) if muts else 0.0,
        "seconds": sum(r.seconds for r in results),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="run mutants whose name contains this")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant")
    ap.add_argument("--no-fork", action="store_true", help="a fresh interpreter per mutant")
    ap.add_argument(
        "--jobs", type=int, default=0, help="mutants side by side (0: one per core, at most 4)"
    )
    ap.add_argument("--keep", default=None, help="keep the copy and logs in this directory")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if args.only in m.name]
    keep = Path(args.keep) if args.keep else None
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results = run(
        chosen, fork=not args.no_fork, timeout=args.timeout, keep=keep, jobs=args.jobs or None
    )
    wall = time.monotonic() - t0
    s = summary(results)
    print("\n| mutant | file | result | first failing test |\n| --- | --- | --- | --- |")
    for r in results:
        if r.status != "baseline":
            print(f"| {r.name} | {r.path} | {r.status} | {r.failed} |")
    print(
        f"\nkilled {s['killed']}/{s['mutants']} = {100 * s['kill_rate']:.0f}% "
        f"in {wall:.0f} s wall ({s['seconds']:.0f} s of runs); survived: {s['survived'] or 'none'}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(s | {"wall_s": wall, "results": [asdict(r) for r in results]}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
