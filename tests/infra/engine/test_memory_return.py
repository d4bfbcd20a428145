"""The engine gives freed per-call buffers back to the OS (``return_large_frees_to_os``).

A long session's calls each allocate and free megabytes (a prefix KV copy, a prefill mask);
with glibc's growing mmap threshold they came from the heap and stayed resident: a rollout
cell serving two ~118K-token sessions passed the 6 GiB worker limit and was restarted."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

PROBE = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {root!r})
    def rss_mb():
        line = next(l for l in open("/proc/self/status") if l.startswith("VmRSS"))
        return int(line.split()[1]) / 1024
    if sys.argv[1] == "on":
        from infra.engine.engine import return_large_frees_to_os
        assert return_large_frees_to_os()
    big = torch.ones(5 << 20); del big  # a freed 20 MB mapping raises glibc's threshold
    base = rss_mb()
    keep, tmp = [], []
    for i in range(300):
        tmp.append(torch.ones(1 << 18))  # 1 MB each, as a call's KV slice or mask
        keep.append(torch.ones(64))  # small live tensors between them pin the heap
    held = rss_mb()
    del tmp
    print(held - base, rss_mb() - base)
    """
)


def _probe(mode: str) -> tuple[float, float]:
    code = PROBE.format(root=str(ROOT))
    # glibc's own defaults: a MALLOC_* variable in the environment (distributed sets
    # MALLOC_TRIM_THRESHOLD_ for its workers) switches its dynamic threshold off
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", code, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env=env,
    ).stdout
    held, after = map(float, out.split())
    return held, after


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_freed_megabyte_buffers_leave_the_resident_set():
    held, after = _probe("on")
    assert held >= 200  # the 300 MB were resident while alive
    assert after <= 0.25 * held, (held, after)  # and gone once freed
    # the control: without it glibc keeps them (if this ever passes, the probe measures nothing)
    held0, after0 = _probe("off")
    assert after0 >= 0.5 * held0, (held0, after0)
