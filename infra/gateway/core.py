"""The gateway's state: sessions, engines, the durable TITO log, and the call pipeline.

Everything here runs on the gateway's event loop (`infra.gateway.gateway.Gateway` owns the
loop and the HTTP server; `infra.gateway.endpoints` are the thin HTTP adapters). Engines join
and leave at run time: a withdrawn cell takes no new calls, its in-flight calls finish (or are
aborted and continue elsewhere from their partial output), and its sessions move to other
cells with their KV, so the harness notices nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from typing import Any

import pyarrow.compute as pc

from infra.engine_api.client import EngineError
from infra.gateway.chat import ChatTokenizer, SessionCalls
from infra.gateway.config import GatewayConfig
from infra.gateway.memory import ReleasingStore, bound_allocators, warm_tito_writer
from infra.gateway.pipeline import CallPipeline
from infra.gateway.responses import restore as restore_responses
from infra.gateway.router import EngineHandle, Router
from infra.gateway.sessions import (
    Session,
    SessionTable,
    end_torn_line,
    read_key_journal,
    restore_calls,
)
from storage.store import Store
from storage.tito_log import TitoLog, table_to_records

log = logging.getLogger(__name__)

# The largest request body (413 past it, before it is read). Harnesses re-send the whole
# conversation on every call, and gyre serves ~1M-token rollouts (presets to 1M+): ~4 bytes a
# token of English is 4 MB, but JSON with ensure_ascii writes each non-ASCII character as a
# 6-byte escape (~9-12 bytes a token of CJK text), tool-call arguments are JSON inside JSON
# (escaped twice), so a legitimate 2M-token body reaches ~30 MB. 64 MiB leaves twice that, and
# costs the gateway ~0.1-0.5 s of parsing (off the event loop) and a few hundred MB at most.
# `gateway.max_body_mb` (a run) and `gyre serve --max-body-mb` set it.
MAX_BODY_BYTES = GatewayConfig().max_body_mb << 20


class GatewayCore:
    """Sessions and keys, routing with affinity, withdrawal with KV move, TITO recording."""

    def __init__(
        self,
        store: Store,
        *,
        run_id: str,
        tokenizer_dir: str,
        spool_dir: str | None = None,
        admin_token: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        model_name: str = "gyre",
        default_max_tokens: int = 1024,
        flush_records: int = 512,
        flush_seconds: float = 2.0,
        wal_fsync: bool = True,
        engine_transport: str | None = None,
        engine_wait_s: float = 120.0,
        engine_token: str | None = None,
    ):
        self.store = store
        self.run_id = run_id
        self.admin_token = admin_token
        self.max_body_bytes = int(max_body_bytes)
        self.default_max_tokens = int(default_max_tokens)
        self.engine_wait_s = float(engine_wait_s)  # a call waits this long for an engine
        self.tok = ChatTokenizer(tokenizer_dir)
        self.model_name = model_name
        self.model_names = {model_name, os.path.basename(os.path.normpath(tokenizer_dir))}
        self.spool_dir = os.path.abspath(spool_dir or tempfile.mkdtemp(prefix="gyre-gateway-"))
        os.makedirs(self.spool_dir, exist_ok=True)
        self._tito_store = ReleasingStore(store)  # its flush thread's Arrow memory given back
        self.tito = TitoLog(
            self._tito_store,
            os.path.join(self.spool_dir, "tito"),
            flush_records=flush_records,
            flush_seconds=flush_seconds,
            fsync=wal_fsync,
        )
        bound_allocators()  # per-call buffers reused or unmapped, not kept (memory.py)
        warm_tito_writer()  # the first flush's imports, now rather than mid-session
        self.sessions = SessionTable(os.path.join(self.spool_dir, "sessions.jsonl"))
        self._restore_pending = {s.session_id for s in self.sessions.all()}
        self._restore_table = None
        self._restore_keys: dict = {}
        self._keys_path = os.path.join(self.spool_dir, "chatkeys.bin")
        end_torn_line(self._keys_path)  # a crash's torn last line is not glued to the next
        self._keys_fh = open(self._keys_path, "ab")  # noqa: SIM115  (append-only journal)
        self.router = Router(engine_transport, engine_token)
        self.pipeline = CallPipeline(self)
        self.counters = {
            "calls": 0,
            "errors": 0,
            "tokens_in": 0,
            "tokens_out": 0,
            "retries": 0,
            "prefix_handles": 0,
            "chat_tail_parses": 0,  # chat bodies parsed from where the last one ended
            "builds_off_loop": 0,  # inputs built on a worker thread (a large session's branch)
        }

    def close(self, *, flush: bool = True) -> None:
        """``flush=False`` leaves unflushed records in the WAL (as a crash would); a new
        gateway on the same ``spool_dir`` replays them into the store."""
        if flush:
            self.tito.close()
        else:
            self.tito.abandon()
        self._keys_fh.close()

    def flush(self) -> None:
        """Write every acknowledged TITO record to the store now."""
        self.tito.flush()

    async def close_clients(self) -> None:
        for h in self.router.engines.values():
            if h.client is not None:
                await h.client.aclose()
                h.client = None

    # -- sessions ------------------------------------------------------------------------
    def new_session(
        self, session_id: str | None = None, *, group_id: str = "", meta: dict | None = None
    ) -> tuple[str, str]:
        """Create a session; returns (session id, API key). Thread-safe."""
        s = self.sessions.new(session_id, group_id=group_id, meta=meta)
        return s.session_id, s.key

    def group_sessions(self, group_id: str) -> list[dict[str, Any]]:
        """The sessions created for ``group_id`` (by any attempt of its rollout task): id,
        meta, calls and unique tokens so far. Thread-safe (a snapshot)."""
        return [
            {"session_id": s.session_id, "meta": dict(s.meta), "calls": s.seq, "tokens": s.tokens}
            for s in self.sessions.all()
            if s.group_id == group_id
        ]

    def session_calls(self, s: Session) -> SessionCalls:
        """The session's call index (rebuilt from the store after a gateway restart, with its
        Responses chains: call this before reading ``s.responses``)."""
        if s.session_id in self._restore_pending:
            self._restore_pending.discard(s.session_id)
            self._restore(s)
            if not self._restore_pending:
                self._restore_table = None
        return s.calls

    def _restore(self, s: Session) -> None:
        """Rebuild a journaled session's call index and Responses chains from the store
        (after a restart)."""
        if self._restore_table is None:  # read once for all journaled sessions
            self._restore_table = self.store.read("tito")
            self._restore_keys = read_key_journal(self._keys_path)
        table = self._restore_table
        mask = pc.and_(
            pc.equal(table["session_id"], s.session_id), pc.equal(table["run_id"], self.run_id)
        )
        keys = self._restore_keys.get(s.session_id, {})
        records = table_to_records(table.filter(mask))
        restore_calls(s, records, keys, self.tok.im_end_id)
        restore_responses(s, records)

    def journal_reply(self, session_id: str, rid: str, msg_key: bytes, reply: bytes) -> None:
        """Remember which messages a chat call answered and its reply's digest, so that after a
        restart the next turn still extends the call exactly."""
        self._keys_fh.write(f"{session_id} {rid} {msg_key.hex()} {reply.hex()}\n".encode())
        self._keys_fh.flush()

    # -- engines -------------------------------------------------------------------------
    async def add_engine_async(self, cell_id: str, base_url: str) -> None:
        h = self.router.add(cell_id, base_url)
        try:
            await self.router.client(h)
        except EngineError:
            del self.router.engines[cell_id]
            raise

    def engines(self) -> dict:
        return self.router.info()

    async def drop_engine_async(self, cell_id: str) -> None:
        """The engine's cell is gone (its process died): route nothing more to it; its
        sessions move at their next call and re-prefill on another cell."""
        h = self.router.engines.get(cell_id)
        if h is not None and h.state != "dead":
            h.state = "dead"
            log.warning("engine %s dropped: its cell is gone", cell_id)

    async def wait_for_engine(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for an active engine; whether one is there."""
        deadline = time.monotonic() + timeout
        while not self.router.active():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def max_context(self) -> int | None:
        limits = [h.max_context for h in self.router.active() if h.max_context]
        return min(limits) if limits else None

    async def withdraw(
        self, cell_id: str, drain_timeout: float, targets: dict[str, str] | None = None
    ) -> dict:
        """Withdraw a cell: no new calls; in-flight calls finish (or, after ``drain_timeout``,
        are aborted and continue elsewhere); its sessions move with their KV.

        ``targets``: group id -> the cell its sessions move to (the scheduler's reroute);
        a group not named, or whose target is not active, goes to the least-loaded cell."""
        h = self.router.engines.get(cell_id)
        if h is None:
            raise KeyError(f"no engine {cell_id!r}")
        h.state = "draining"
        deadline = time.monotonic() + drain_timeout
        while h.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        aborted = 0
        if h.inflight and h.client is not None:
            for erid in list(h.inflight):
                try:
                    await h.client.abort(erid)
                    aborted += 1
                except EngineError as exc:
                    log.warning("abort of %s on %s failed: %s", erid, cell_id, exc)
            while h.inflight and time.monotonic() < deadline + 30:
                await asyncio.sleep(0.005)
        # calls that finished generating but are not recorded yet: their context is the KV to move
        pinned = [self.sessions.get(sid) for sid in list(h.sessions)]
        while (
            any(x is not None and x.unrecorded for x in pinned) and time.monotonic() < deadline + 30
        ):
            await asyncio.sleep(0.002)
        stalled = [x.session_id for x in pinned if x is not None and x.unrecorded]
        if stalled:
            log.error("withdrawal of %s: sessions %s still have unrecorded calls", cell_id, stalled)
        moves_before = (self.router.kv_moves, self.router.kv_moved_tokens, self.router.reprefills)
        moved = 0
        for sid in list(h.sessions):
            s = self.sessions.get(sid)
            if s is not None and s.cell_id == cell_id and self.router.active():
                await self._relocate(s, h, (targets or {}).get(s.group_id))
                moved += 1
        if self.router.engines.get(cell_id) is h:  # not re-added meanwhile
            del self.router.engines[cell_id]
        if h.client is not None:
            await h.client.aclose()
            h.client = None
        return {
            "cell_id": cell_id,
            "sessions_moved": moved,
            "aborted_inflight": aborted,
            "kv_moves": self.router.kv_moves - moves_before[0],
            "kv_tokens": self.router.kv_moved_tokens - moves_before[1],
            "reprefills": self.router.reprefills - moves_before[2],
        }

    async def _relocate(self, s: Session, old: EngineHandle, target: str | None = None) -> None:
        async with s.lock:
            if s.cell_id != old.cell_id:
                return
            new = self.router.engines.get(target) if target else None
            if new is None or new.state != "active" or new is old:
                new = self.router.pick_new(exclude={old.cell_id})
            if s.last_request_id is not None and old.state != "dead":
                with s.state_lock:
                    ctx = s.calls.context(s.last_request_id).tolist()
                await self.router.move_kv(old, new, ctx)
            elif s.last_request_id is not None:
                self.router.reprefills += 1  # its KV died with the cell: the new one prefills
            self.router.assign(s.session_id, new, old)
            s.cell_id = new.cell_id

    async def cell_for(self, s: Session) -> EngineHandle:
        """The session's cell (affinity), after moving it off a withdrawn or dead one."""
        h = self.router.engines.get(s.cell_id) if s.cell_id else None
        if h is not None and h.state == "active":
            return h
        if h is not None:
            await self._relocate(s, h)
        else:
            async with s.lock:
                if s.cell_id is None or s.cell_id not in self.router.engines:
                    new = self._placed(s) or self.router.pick_new()
                    self.router.assign(s.session_id, new, None)
                    s.cell_id = new.cell_id
        return self.router.engines[s.cell_id]

    def _placed(self, s: Session) -> EngineHandle | None:
        """The cell a scheduler placed the session on (``meta["cell_id"]`` at creation), if
        it serves: the scheduler chose it for its weights and its free slots."""
        h = self.router.engines.get(str((s.meta or {}).get("cell_id") or ""))
        return h if h is not None and h.state == "active" else None

    async def end_session_async(self, session_id: str) -> None:
        """See `Gateway.end_session`."""
        s = self.sessions.get(session_id)
        h = self.router.engines.get(s.cell_id) if s is not None and s.cell_id else None
        if h is not None:
            h.sessions.discard(session_id)

    # -- metrics -------------------------------------------------------------------------
    def session_bytes(self) -> int:
        """Bytes the sessions' call indexes and engine-input caches hold (see
        `SessionCalls.held_bytes`): what grows with their tokens."""
        total = 0
        for s in self.sessions.all():
            with s.state_lock:
                total += s.calls.held_bytes() + s.ids_json.nbytes
        return total

    def stats(self) -> dict:
        """Flat metrics; ``gateway/loop_cpu_s`` is the event-loop thread's CPU time when called
        on the loop (the HTTP endpoint does), else the calling thread's; ``gateway/cpu_s`` is
        the whole process's."""
        return {
            "gateway/loop_cpu_s": time.thread_time(),
            "gateway/cpu_s": time.process_time(),
            **{f"gateway/{k}": v for k, v in self.counters.items()},
            "gateway/sessions": len(self.sessions),
            "gateway/session_bytes": self.session_bytes(),
            "gateway/kv_moves": self.router.kv_moves,
            "gateway/kv_moved_tokens": self.router.kv_moved_tokens,
            "gateway/reprefills": self.router.reprefills,
            "gateway/arrow_releases": self._tito_store.releases,
            **{f"tito/{k}": v for k, v in self.tito.stats.items()},
            "engines": self.router.info(),
        }
