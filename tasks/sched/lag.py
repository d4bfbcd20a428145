"""Policy lag: when a streaming step may start and how many rollouts may start.

The lag of a trained token is ``w - u``: ``w`` the weights version the
optimizer step starts from, ``u`` the version that generated the token. A
rollout's lag is that of its oldest token, its *base version* (see
``SchedState.versions``). Colocate trains at lag 0; a one-step-off async
pipeline at lag <= 1.

To keep every trained token within ``max_lag`` (``L``) two rules suffice:

- **step gate**: a step from weights ``w`` may start only when every rollout of
  base ``<= w - L`` has finished -- after step ``w`` none of them could be
  trained within the bound -- and it trains them first (``order="oldest"``);
- **admission**: rollouts of base ``<= u`` must all be trained by step
  ``u + L``, i.e. among the first ``(u + L + 1) * batch`` samples, so once the
  newest weights are ``v`` at most ``(v + L + 1) * batch`` rollouts may have
  started (on cells holding ``v``).

With admission, at step ``w`` the rollouts of base ``<= w - L`` not yet trained
are at most ``(w + 1) * batch - w * batch = batch``: the gate never asks a step
for more than it takes, so the bound holds by construction.

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import math

from tasks.sched.coordinator import SchedState


def finished_total(s: SchedState) -> int:
    return sum(x.finished for x in s.versions)


def gating(s: SchedState, max_lag: int, version: int | None = None) -> tuple[int, float]:
    """Rollouts in flight that the next step from ``version`` must wait for.

    Returns their count and the oldest one's start time (``inf`` when none).
    """
    w = s.version if version is None else version
    n, oldest = 0, math.inf
    for x in s.versions:
        if x.version > w - max_lag:
            break
        n += x.in_flight
        oldest = min(oldest, x.oldest_start)
    return n, oldest


def step_ready(s: SchedState, batch: int, max_lag: int) -> bool:
    """A lag-bounded streaming step of ``batch`` samples may start now."""
    if s.step_running or finished_total(s) < batch:
        return False
    return gating(s, max_lag)[0] == 0


def admissible(s: SchedState, batch: int, max_lag: int) -> int:
    """How many more rollouts may start now on cells holding ``s.version``."""
    return max(0, (s.version + max_lag + 1) * batch - s.started)


def step_eta(
    s: SchedState, batch: int, max_lag: int, timeout_s: float, version: int, taken: int = 0
) -> float:
    """Seconds until a step from ``version`` can start, at most (inf if unknown).

    The gate waits for in-flight rollouts of base ``<= version - max_lag``;
    none runs past its start plus ``timeout_s`` (pauses aside). The water must
    also hold a batch; at the smoothed finish rate that takes
    ``(batch - finished) / rate``. ``taken``: samples a step booked in the
    same tick takes off the water (not yet in ``s``).
    """
    n, oldest = gating(s, max_lag, version)
    eta_lag = 0.0 if n == 0 else max(0.0, oldest + timeout_s - s.now)
    short = batch - (finished_total(s) - taken)
    if short <= 0:
        eta_water = 0.0
    elif s.finish_rate > 0:
        eta_water = short / s.finish_rate
    else:
        eta_water = math.inf
    return max(eta_lag, eta_water)
