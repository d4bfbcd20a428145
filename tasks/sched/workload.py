"""The simulated xLong workload: its parameters, its rollout durations, its files.

A :class:`Workload` is everything the simulator needs to know about a run and
its costs; every scheduling mode sees the same one. Rollout ``i`` (by start
order) has the same duration in every mode: one seeded stream per (workload,
seed). A run is a fixed amount of work -- ``steps`` optimizer steps of
``batch`` samples -- so throughput is that work over the time a mode needs.

Durations are log-normal, cut at ``timeout_s`` (the harness's rollout cap; a
cut rollout is still scored, partially). The median may move over the run:

- ``growth``: the median grows geometrically with the rollout index, from
  ``median_s`` at the first rollout to ``growth * median_s`` at rollout
  ``steps * batch`` (the policy learns longer horizons as it trains); after
  that it stays.
- bursts: of every ``burst_every`` batches' worth of rollouts, the last
  ``burst_len`` batches' worth have their median multiplied by
  ``burst_factor`` (a wave of hard tasks; a run starts calm). In batches, so a
  pattern means the same at every cluster size.

Training may grow with the rollouts: with ``train_follows_length`` a sample's
training cost is proportional to its rollout's duration (a longer rollout has
more tokens to train on), ``train_s_per_sample * d_i / mean0`` cell-seconds
with ``mean0`` the mean rollout duration at the start of the run
(:meth:`Workload.train_cost`). So ``train_s_per_sample`` stays the mean cost
of a sample at the start of the run, and as the median grows ``growth`` times
the mean training cost of a sample grows with it. Off (the default), every
sample costs ``train_s_per_sample``.

Files: YAML or JSON mappings of these field names (see bench/workloads/README.md);
unknown keys and bad values are reported together (:class:`WorkloadError`).
Pure module: no prefect, no distributed; reading a file is the only I/O.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np


class WorkloadError(ValueError):
    """A workload file or value is wrong; the message lists every problem and its fix."""


@dataclass(frozen=True)
class Workload:
    """One simulated run and its costs (seconds; sizes in cells, sessions, samples).

    ``train_follows_length``: a sample's training cost is in proportion to its
    rollout's generation time, ``train_s_per_sample * d / start_mean_s`` (see
    :meth:`train_cost`): ``train_s_per_sample`` is then the mean sample's cost
    at the start of the run, and training grows as rollouts lengthen. Off (the
    default): every sample costs ``train_s_per_sample``.
    """

    name: str = "workload"
    # the pool
    cells: int = 1000
    devices_per_cell: int = 1
    cap: int = 4
    # the run: fixed work
    batch: int = 4000
    steps: int = 48
    # rollout durations
    median_s: float = 1800.0
    sigma: float = 1.0
    timeout_s: float = 4 * 3600.0
    growth: float = 1.0
    burst_every: float = 0.0
    burst_len: float = 0.0
    burst_factor: float = 1.0
    # sessions
    call_s: float = 60.0
    # training
    train_s_per_sample: float = 60.0
    train_follows_length: bool = False
    dp_sync_s: float = 2.0
    # switching costs
    weight_load_s: float = 30.0
    switch_s: float = 60.0
    migrate_s: float = 5.0
    reprefill_s: float = 60.0
    kv_move: bool = True
    # the executor's own costs, 0 in a pure simulation (bench/modes.py measures them live):
    # from a rollout's last token to its sample in the buffer (harness exit, scoring,
    # processing; its slot stays booked), and a fixed cost per optimizer step (task starts,
    # DP rendezvous, checkpoint commit)
    finish_delay_s: float = 0.0
    step_overhead_s: float = 0.0
    # their spread (live they are not constant: a lag-gated streaming step waits for the
    # latest finishes, so the tail matters, not only the mean): each rollout's finish
    # delay, processing (trajectory processing before its sample is in the buffer, the
    # slot still booked) and each step's overhead are log-normal draws with these means
    # and shapes (0 = every one at the mean), one seeded stream each, the same in every
    # mode; and a DP regroup: extra seconds of a step whose members differ from the last
    # step's (a new DP generation)
    finish_delay_sigma: float = 0.0
    process_s: float = 0.0
    process_sigma: float = 0.0
    step_overhead_sigma: float = 0.0
    regroup_s: float = 0.0
    # simulation
    tick_s: float = 15.0
    max_hours: float = 2000.0

    def __post_init__(self) -> None:
        errs = _problems(self)
        if errs:
            raise WorkloadError(f"workload {self.name!r}: " + "; ".join(errs))

    @property
    def total_rollouts(self) -> int:
        """Rollouts the run trains: ``steps * batch``."""
        return self.steps * self.batch

    @property
    def start_mean_s(self) -> float:
        """Mean rollout duration at the start of the run (no growth, no wave yet)."""
        return capped_mean(self.median_s, self.sigma, self.timeout_s)

    def train_cost(self, duration: float) -> float:
        """Cell-seconds to train one sample whose rollout generated for ``duration`` s.

        ``train_s_per_sample`` when training does not follow length; otherwise
        ``train_s_per_sample * duration / start_mean_s`` (tokens ~ generation time).
        """
        if not self.train_follows_length:
            return self.train_s_per_sample
        return self.train_s_per_sample * duration / self.start_mean_s

    def mean_train_cost(self, median: float) -> float:
        """Expected :meth:`train_cost` of a rollout of median ``median``."""
        if not self.train_follows_length:
            return self.train_s_per_sample
        return self.train_cost(capped_mean(median, self.sigma, self.timeout_s))

    def median_at(self, i: int) -> float:
        """Median duration of rollout ``i`` (growth and bursts applied)."""
        frac = min(1.0, i / max(1, self.total_rollouts))
        m = self.median_s * self.growth**frac
        if self._in_wave(i):
            m *= self.burst_factor
        return m

    def _in_wave(self, i: int) -> bool:
        every, n = self.burst_every, self.burst_len
        return every > 0 and n > 0 and (i / self.batch) % every >= every - n

    def frozen_at_start(self) -> Workload:
        """The workload as it looks in its first hour, assumed to stay so.

        What a user sees before picking a split: no growth yet, and no wave of
        hard tasks yet (a run starts calm).
        """
        return dataclasses.replace(
            self,
            name=f"{self.name} (first hour)",
            growth=1.0,
            burst_every=0.0,
            burst_len=0.0,
            burst_factor=1.0,
        )

    def regrain(self, devices_per_cell: int) -> Workload:
        """The same devices cut into cells of ``devices_per_cell`` devices.

        A cell of ``g`` devices serves ``g / g0`` times the sessions and trains
        ``g / g0`` times faster than one of ``g0``; the batch, the durations
        and the per-member sync cost stay.
        """
        g0, g = self.devices_per_cell, devices_per_cell
        devices = self.cells * g0
        if g < 1 or devices % g or (self.cap * g) % g0:
            raise WorkloadError(
                f"cannot cut {devices} devices ({self.cells} cells x {g0}) into cells of {g}: "
                "pick a divisor of the device count"
            )
        return dataclasses.replace(
            self,
            name=f"{self.name} ({g} devices/cell)",
            cells=devices // g,
            devices_per_cell=g,
            cap=self.cap * g // g0,
            train_s_per_sample=self.train_s_per_sample * g0 / g,
        )

    def resized(self, cells: int) -> Workload:
        """The same workload on ``cells`` cells; the batch stays one sample per slot."""
        per_slot = self.batch / (self.cells * self.cap)
        return dataclasses.replace(
            self,
            name=f"{self.name} ({cells} cells)",
            cells=cells,
            batch=max(1, round(per_slot * cells * self.cap)),
        )

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _problems(w: Workload) -> list[str]:
    errs = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            errs.append(msg)

    need(w.cells >= 2, f"cells={w.cells}: need at least 2 (one to roll out, one to train)")
    need(w.devices_per_cell >= 1, f"devices_per_cell={w.devices_per_cell}: need >= 1")
    need(w.cap >= 1, f"cap={w.cap}: need >= 1 session per cell")
    need(w.batch >= 1, f"batch={w.batch}: need >= 1 sample per step")
    need(w.steps >= 1, f"steps={w.steps}: need >= 1 optimizer step")
    need(w.median_s > 0, f"median_s={w.median_s}: need > 0")
    need(w.sigma >= 0, f"sigma={w.sigma}: need >= 0")
    need(w.timeout_s > 0, f"timeout_s={w.timeout_s}: need > 0 (the rollout cap)")
    need(w.growth > 0, f"growth={w.growth}: need > 0 (1 = stationary)")
    need(w.burst_every >= 0 and w.burst_len >= 0, "burst_every/burst_len: need >= 0")
    need(
        w.burst_every == 0 or w.burst_len < w.burst_every,
        f"burst_len={w.burst_len} must be < burst_every={w.burst_every}",
    )
    need(w.burst_factor > 0, f"burst_factor={w.burst_factor}: need > 0")
    for k in ("call_s", "train_s_per_sample", "tick_s", "max_hours"):
        need(getattr(w, k) > 0, f"{k}={getattr(w, k)}: need > 0")
    for k in (
        "dp_sync_s",
        "weight_load_s",
        "switch_s",
        "migrate_s",
        "reprefill_s",
        "finish_delay_s",
        "step_overhead_s",
        "finish_delay_sigma",
        "process_s",
        "process_sigma",
        "step_overhead_sigma",
        "regroup_s",
    ):
        need(getattr(w, k) >= 0, f"{k}={getattr(w, k)}: need >= 0")
    return errs


_FIELDS = {f.name: f for f in fields(Workload)}


def workload_from_dict(d: dict[str, object], base: Workload | None = None) -> Workload:
    """Build a workload from a mapping; every unknown key and bad value reported at once.

    ``base``: missing keys take its values (default: :class:`Workload`'s defaults).
    """
    errs = []
    kw: dict[str, object] = {}
    for k, v in d.items():
        f = _FIELDS.get(k)
        if f is None:
            errs.append(f"unknown key {k!r} (known: {', '.join(sorted(_FIELDS))})")
            continue
        typ = f.type if isinstance(f.type, str) else f.type.__name__
        try:
            if typ == "bool":
                if not isinstance(v, bool):
                    raise TypeError
                kw[k] = v
            elif typ == "int":
                if isinstance(v, bool) or not float(v).is_integer():  # type: ignore[arg-type]
                    raise TypeError
                kw[k] = int(v)  # type: ignore[call-overload]
            elif typ == "float":
                if isinstance(v, bool):
                    raise TypeError
                kw[k] = float(v)  # type: ignore[arg-type]
            else:
                kw[k] = str(v)
        except (TypeError, ValueError):
            errs.append(f"{k}={v!r}: expected {typ}")
    start = base or Workload()
    try:
        w = dataclasses.replace(start, **kw)
    except WorkloadError as e:
        errs.append(str(e))
        w = None
    if errs:
        raise WorkloadError("; ".join(errs))
    assert w is not None
    return w


def load_workload(path: str | Path, base: Workload | None = None) -> Workload:
    """Read a YAML (``.yaml``/``.yml``) or JSON workload file.

    A file may name ``base: reference`` (a file beside it, without extension)
    to start from; its own keys override. ``name`` defaults to the file stem.
    """
    p = Path(path)
    if not p.exists():
        raise WorkloadError(
            f"workload file {str(p)!r} does not exist: give a path to a .yaml/.json"
        )
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        import yaml

        d = yaml.safe_load(text)
    elif p.suffix == ".json":
        d = json.loads(text)
    else:
        raise WorkloadError(f"workload file {str(p)!r}: use .yaml, .yml or .json")
    if not isinstance(d, dict):
        raise WorkloadError(f"workload file {str(p)!r}: expected a mapping of field: value")
    d = dict(d)
    d.pop("why", None)  # the reasoning, kept in the file for readers
    parent = d.pop("base", None)
    if parent is not None:
        cands = [p.with_name(f"{parent}{ext}") for ext in (".yaml", ".yml", ".json")]
        found = next((c for c in cands if c.exists()), None)
        if found is None:
            raise WorkloadError(f"workload file {str(p)!r}: base {parent!r} not found beside it")
        base = load_workload(found, base)
    d.setdefault("name", p.stem)
    return workload_from_dict(d, base)


_CHUNK = 4096


class Durations:
    """Rollout ``i``'s duration, the same for every mode (one seeded stream).

    ``durations[i] = min(timeout, median_at(i) * exp(sigma * z_i))`` with
    ``z_i`` standard normal from the seed: the same ``z_i`` whatever the
    workload's medians, so two workloads differ only where their parameters do.
    """

    def __init__(self, w: Workload, seed: int) -> None:
        self._w = w
        self._rng = np.random.default_rng(seed)
        self._vals: list[float] = []

    def __getitem__(self, i: int) -> float:
        while i >= len(self._vals):
            n0 = len(self._vals)
            z = self._rng.standard_normal(_CHUNK)
            idx = np.arange(n0, n0 + _CHUNK)
            med = _medians(self._w, idx)
            self._vals.extend(
                np.minimum(med * np.exp(self._w.sigma * z), self._w.timeout_s).tolist()
            )
        return self._vals[i]


class Spread:
    """Draw ``i`` of a log-normal cost with mean ``mean`` and shape ``sigma``, the same for
    every mode: ``mean * exp(sigma * z_i - sigma^2 / 2)`` with ``z_i`` standard normal from
    ``(seed, stream)``; exactly ``mean`` when ``sigma`` is 0 (no draw is made)."""

    def __init__(self, mean: float, sigma: float, seed: int, stream: int) -> None:
        self._mean, self._sigma = mean, sigma
        self._rng = np.random.default_rng([seed, stream]) if sigma > 0 and mean > 0 else None
        self._vals: list[float] = []

    def __getitem__(self, i: int) -> float:
        if self._rng is None:
            return self._mean
        while i >= len(self._vals):
            z = self._rng.standard_normal(_CHUNK)
            s = self._sigma
            self._vals.extend((self._mean * np.exp(s * z - s * s / 2)).tolist())
        return self._vals[i]


def lognormal_shape(values: list[float]) -> float:
    """The log-normal ``sigma`` with the sample mean and variance of ``values`` (what a live
    bench measured: ``sqrt(ln(1 + var / mean^2))``); 0 for fewer than two or a mean <= 0."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    if mean <= 0:
        return 0.0
    var = sum((x - mean) ** 2 for x in values) / (n - 1)
    return math.sqrt(math.log(1.0 + var / (mean * mean)))


def _medians(w: Workload, idx: np.ndarray) -> np.ndarray:
    frac = np.minimum(1.0, idx / max(1, w.total_rollouts))
    m = w.median_s * w.growth**frac
    if w.burst_every > 0 and w.burst_len > 0:
        wave = (idx / w.batch) % w.burst_every >= w.burst_every - w.burst_len
        m = np.where(wave, m * w.burst_factor, m)
    return m


# ---- the duration distribution, in closed form (for the bound and the splits) ----------


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def capped_mean(median: float, sigma: float, cap: float) -> float:
    """E[min(cap, D)] for D log-normal(ln median, sigma)."""
    if sigma == 0:
        return min(median, cap)
    mu = math.log(median)
    a = (math.log(cap) - mu) / sigma
    # E[D; D < cap] + cap * P(D >= cap)
    return math.exp(mu + sigma * sigma / 2) * _phi(a - sigma) + cap * (1.0 - _phi(a))


def capped_quantile(median: float, sigma: float, cap: float, q: float) -> float:
    """The ``q`` quantile of min(cap, D)."""
    lo, hi = -10.0, 10.0
    for _ in range(80):  # bisection on the standard normal CDF
        mid = (lo + hi) / 2
        if _phi(mid) < q:
            lo = mid
        else:
            hi = mid
    return min(cap, median * math.exp(sigma * (lo + hi) / 2))


@functools.lru_cache(maxsize=4096)
def expected_max(median: float, sigma: float, cap: float, n: int) -> float:
    """E[max of ``n`` i.i.d. min(cap, D)], by integrating the survival function."""
    if n <= 0:
        return 0.0
    if sigma == 0:
        return min(median, cap)
    mu = math.log(median)
    # E[max] = int_0^cap 1 - F(x)^n dx, on a log grid (the integrand is smooth in ln x)
    k = 2000
    lo = math.log(cap) - 12.0 * max(sigma, 0.1)
    total, prev_x, prev_y = 0.0, 0.0, 1.0
    for j in range(k + 1):
        x = math.exp(lo + (math.log(cap) - lo) * j / k)
        y = 1.0 - _phi((math.log(x) - mu) / sigma) ** n
        total += (x - prev_x) * (y + prev_y) / 2
        prev_x, prev_y = x, y
    return total
