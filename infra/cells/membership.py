"""Which worker process holds each logical cell, and what to do when one dies.

The coordinator counts cells by index (0..n-1) and never learns that a worker process
died: the executor keeps each index alive. When a cell's worker disappears from the
cluster (SIGKILL, OOM, a lost node), the index is *lost*; a worker the cluster gains (the
nanny restarts a killed worker at a new address, or a new ``dask worker`` joins) is a
*spare*, and the lost index is *healed* by binding it to the spare, which then takes the
cell's role. An index that no spare heals within ``heal_timeout_s`` is *overdue*: the run
stops with an error that says what it waited for, it never hangs.

This module is bookkeeping only (addresses in, decisions out), so it is tested without a
cluster; `infra.cells.executor` carries the decisions out.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Observed:
    """What one look at the cluster's workers means for the cells."""

    lost: tuple[int, ...] = ()  # cells whose worker vanished since the last look
    heal: tuple[tuple[int, str], ...] = ()  # (cell, spare worker address) to bind now
    overdue: tuple[tuple[int, float], ...] = ()  # (cell, seconds lost) past the bound


@dataclass
class Membership:
    """Logical cell -> worker address, with losses and their healing."""

    addrs: list[str]
    heal_timeout_s: float = 120.0
    lost_since: dict[int, float] = field(default_factory=dict)
    healing: set[int] = field(default_factory=set)  # bound to a spare, role not yet restored
    retired: set[str] = field(default_factory=set)  # addresses that held a cell and died

    def observe(self, alive: set[str], now: float) -> Observed:
        """Compare the cells' workers with the workers ``alive`` at time ``now``.

        A lost cell is offered at most one spare per look (lowest index first, spares in
        address order), and only while it is not already being healed.
        """
        lost = []
        for i, a in enumerate(self.addrs):
            if a not in alive and i not in self.lost_since:
                self.lost_since[i] = now
                self.retired.add(a)
                lost.append(i)
        spares = sorted(alive - set(self.addrs) - self.retired)
        heal = []
        for i in sorted(self.lost_since):
            if i in self.healing or not spares:
                continue
            addr = spares.pop(0)
            self.addrs[i] = addr
            self.healing.add(i)
            heal.append((i, addr))
        overdue = tuple(
            (i, now - t)
            for i, t in sorted(self.lost_since.items())
            if i not in self.healing and now - t > self.heal_timeout_s
        )
        return Observed(tuple(lost), tuple(heal), overdue)

    def healed(self, i: int) -> None:
        """Cell ``i``'s new worker has taken its role."""
        self.healing.discard(i)
        self.lost_since.pop(i, None)

    def heal_failed(self, i: int) -> None:
        """The spare bound to ``i`` died too: ``i`` waits for the next spare."""
        self.retired.add(self.addrs[i])
        self.healing.discard(i)

    def is_lost(self, i: int) -> bool:
        return i in self.lost_since
