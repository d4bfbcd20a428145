"""Engines behind the gateway: session affinity, least-loaded placement, withdrawal.

Policy and mechanism apart: ``pick_new`` is a pure decision over the current load; the gateway
carries it out. A cell is ``active`` (takes new work) or ``draining`` (withdrawn: finishes what
it runs, takes nothing new, then leaves). A session stays on its cell while the cell is
active; when it is withdrawn, the session's next call goes to another cell, after the session's
KV was moved there (export/import, when both engines support it) or, failing that, the new cell
simply re-prefills from its own prefix cache.

All methods run on the gateway's event loop (single-threaded), so there are no locks here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from infra.engine_api.client import EngineClient, EngineError

log = logging.getLogger(__name__)


class NoEngineError(RuntimeError):
    """No active engine to serve a call (503 for the harness)."""


@dataclass(eq=False)
class EngineHandle:
    cell_id: str
    base_url: str
    client: EngineClient | None = None
    state: str = "active"  # active | draining | dead (its cell is gone)
    inflight: dict[str, float] = field(default_factory=dict)  # engine rid -> start time
    sessions: set[str] = field(default_factory=set)
    calls: int = 0
    tokens: int = 0
    errors: int = 0
    max_context: int | None = None
    vocab_size: int | None = None
    kv_supported: bool | None = None  # None: not probed yet
    # the embedded engine holds finished contexts by rid: a call may send a prefix handle
    # plus its new ids (infra/engine/server.py: PrefixContexts); SGLang gets full ids
    prefix_handles: bool = False
    added_at: float = field(default_factory=time.time)

    def load(self) -> tuple[int, int]:
        return (len(self.inflight), len(self.sessions))

    def info(self) -> dict:
        return {
            "base_url": self.base_url,
            "state": self.state,
            "inflight": len(self.inflight),
            "sessions": len(self.sessions),
            "calls": self.calls,
            "tokens": self.tokens,
            "errors": self.errors,
            "max_context": self.max_context,
            "kv_supported": self.kv_supported,
        }


class Router:
    """Cells the gateway may send calls to, and which session is on which cell."""

    def __init__(self, transport: str | None = None, token: str | None = None) -> None:
        self.transport = transport  # the engine clients' (None: the client's default)
        self.token = token  # the run's token, sent to every engine (required beyond loopback)
        self.engines: dict[str, EngineHandle] = {}
        self.kv_moves = 0
        self.kv_moved_tokens = 0
        self.reprefills = 0

    def add(self, cell_id: str, base_url: str) -> EngineHandle:
        old = self.engines.get(cell_id)
        if old is not None and old.state == "active":
            raise ValueError(f"engine {cell_id!r} is already added ({old.base_url})")
        h = EngineHandle(cell_id, base_url.rstrip("/"))
        self.engines[cell_id] = h
        return h

    async def client(self, h: EngineHandle) -> EngineClient:
        """The handle's client, created on the event loop, with the model's limits probed."""
        if h.client is None:
            h.client = EngineClient(h.base_url, transport=self.transport, token=self.token)
        if h.max_context is None:
            info = await h.client.model_info()
            h.max_context = int(info.get("max_context_length") or info.get("context_length") or 0)
            h.vocab_size = int(info.get("vocab_size") or 0) or None
            try:
                version = str((await h.client.server_info()).get("version") or "")
            except Exception:  # an engine without /get_server_info: full ids, as always
                version = ""
            h.prefix_handles = version.startswith("gyre-embedded")
        return h.client

    def active(self) -> list[EngineHandle]:
        return [h for h in self.engines.values() if h.state == "active"]

    def pick_new(self, exclude: set[str] = frozenset()) -> EngineHandle:
        """Least-loaded active cell (in-flight calls, then pinned sessions, then age)."""
        cands = [h for h in self.active() if h.cell_id not in exclude]
        if not cands:
            raise NoEngineError("no rollout engine is available")
        return min(cands, key=lambda h: (*h.load(), h.added_at))

    def assign(self, session_id: str, h: EngineHandle, old: EngineHandle | None) -> None:
        if old is not None:
            old.sessions.discard(session_id)
        h.sessions.add(session_id)

    async def move_kv(self, old: EngineHandle, new: EngineHandle, context: list[int]) -> int:
        """Move the KV of ``context``'s cached prefix from ``old`` to ``new``; 0 if not done
        (the new cell then re-prefills from its own prefix cache)."""
        if not context or old.kv_supported is False or new.kv_supported is False:
            self.reprefills += 1
            return 0
        for side, h in (("export", old), ("import", new)):
            try:
                client = await self.client(h)
                if side == "export":
                    blob = await client.export_kv(context)
                else:
                    n = await client.import_kv(blob)
            except EngineError as exc:
                if exc.status in (404, 405, 501):  # a backend without the gyre KV extension
                    h.kv_supported = False
                log.warning(
                    "KV %s on %s failed (%s -> %s), re-prefill instead: %s",
                    side, h.cell_id, old.cell_id, new.cell_id, exc,
                )  # fmt: skip
                self.reprefills += 1
                return 0
        old.kv_supported = new.kv_supported = True
        self.kv_moves += 1
        self.kv_moved_tokens += n
        return n

    def info(self) -> dict:
        return {cid: h.info() for cid, h in self.engines.items()}
