"""Member processes for the DP tests (tests/tasks/test_dp.py), in a module of their own: a
spawned member imports only this, torch and tasks/train/dp.py (not the tests' model and
data helpers), so that it starts in a second of CPU."""

from __future__ import annotations

import time
import traceback

import torch

from tasks.train import dp


def generations(inbox, out) -> None:
    """A member that forms each generation it is told (after ``delay`` seconds), sums its
    rank + 1 over the group and leaves the group again."""
    try:
        while (msg := inbox.get()) is not None:
            rv, delay = msg
            time.sleep(delay)
            group = dp.DPGroup(rv, backend="gloo", timeout_s=20)
            t = torch.tensor([float(rv.rank + 1)])
            torch.distributed.all_reduce(t)
            group.close()
            out.put((rv.generation, rv.rank, float(t[0])))
    except BaseException:
        out.put((-1, -1, traceback.format_exc()))
