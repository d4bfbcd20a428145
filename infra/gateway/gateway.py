"""The gateway: what an agent harness talks to (DESIGN.md §5 "Gateway").

An OpenAI-compatible HTTP server (``/v1/chat/completions`` with tools and streaming,
``/v1/completions``, ``/v1/models``) plus SGLang's native ``/generate`` for token-level
harnesses, in front of any number of engines reached only through `EngineClient`. For each call
it turns messages into token ids with token exactness (`infra.gateway.chat`), routes the call to a cell
with session affinity (`infra.gateway.router`), and appends a TITO record to a durable `TitoLog` *before*
the response (or the final stream chunk) goes out. The OpenAI ``id`` of a response is the TITO
``request_id``; harnesses report sub-task scores against it on ``POST /gyre/scores``.

Sessions are named by API keys (``Authorization: Bearer <key>``), one per rollout, made by
``Gateway.new_session`` or the admin endpoint ``POST /gyre/sessions``. Cells join and leave at
run time (``add_engine`` / ``remove_engine``): a withdrawn cell's sessions continue on another
cell with their KV moved, and the harness notices nothing. A session created with
``meta={"cell_id": ...}`` starts on that cell while it serves (a scheduler's placement).

The HTTP layer is in `infra.gateway.endpoints`; this module holds the state and the call pipeline.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.compute as pc
import uvicorn

from infra.engine_api.client import EngineError
from infra.gateway.chat import ChatInput, ChatTokenizer, SessionCalls, apply_stop, digest
from infra.gateway.router import EngineHandle, NoEngineError, Router
from infra.gateway.sessions import Session, SessionTable, read_key_journal, restore_calls
from infra.gateway.wire import ApiError, GenParams
from storage.store import Store
from storage.tito import TitoRecord
from storage.tito_log import TitoLog, table_to_records

log = logging.getLogger(__name__)

_VERSION_DIGITS = re.compile(r"(-?\d+)\s*$")
MAX_ATTEMPTS = 6  # engine attempts per call (withdrawal, aborts, dead cells)
OFFLOAD_TOKENS = 65_536  # sessions at least this large build inputs off the event loop


def parse_weight_version(v: Any) -> int:
    """SGLang sends the version as a string ("3", "v3", "step-3"); -1 when it has no number."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    m = _VERSION_DIGITS.search(str(v or ""))
    return int(m.group(1)) if m else -1


@dataclass
class GenResult:
    output_ids: list[int]
    logprobs: list[float]
    finish: dict  # SGLang finish_reason ({"type": stop|length|abort, ...})
    weight_version: int
    cached_tokens: int
    cell_id: str
    t_start: float
    t_end: float
    session: Session | None = None  # set while the call is generated but not yet recorded
    recorded: bool = False

    @property
    def finish_type(self) -> str:
        return str(self.finish.get("type") or "stop")


class Gateway:
    """OpenAI-compatible gateway with sessions, routing and durable TITO recording."""

    def __init__(
        self,
        store: Store,
        *,
        run_id: str,
        tokenizer_dir: str,
        spool_dir: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        admin_token: str | None = None,
        max_body_bytes: int = 64 << 20,
        model_name: str = "gyre",
        default_max_tokens: int = 1024,
        flush_records: int = 512,
        flush_seconds: float = 2.0,
        wal_fsync: bool = True,
    ):
        self.store = store
        self.run_id = run_id
        self.host = host
        self.port = port
        self.admin_token = admin_token
        self.max_body_bytes = int(max_body_bytes)
        self.default_max_tokens = int(default_max_tokens)
        self.tok = ChatTokenizer(tokenizer_dir)
        self.model_name = model_name
        self.model_names = {model_name, os.path.basename(os.path.normpath(tokenizer_dir))}
        self.spool_dir = os.path.abspath(spool_dir or tempfile.mkdtemp(prefix="gyre-gateway-"))
        os.makedirs(self.spool_dir, exist_ok=True)
        self.tito = TitoLog(
            store,
            os.path.join(self.spool_dir, "tito"),
            flush_records=flush_records,
            flush_seconds=flush_seconds,
            fsync=wal_fsync,
        )
        self.sessions = SessionTable(os.path.join(self.spool_dir, "sessions.jsonl"))
        self._restore_pending = {s.session_id for s in self.sessions.all()}
        self._restore_table = None
        self._restore_keys: dict = {}
        self._keys_path = os.path.join(self.spool_dir, "chatkeys.bin")
        self._keys_fh = open(self._keys_path, "ab")  # noqa: SIM115  (append-only journal)
        self.router = Router()
        self._pending_engines: list[tuple[str, str]] = []
        self.counters = {"calls": 0, "errors": 0, "tokens_in": 0, "tokens_out": 0, "retries": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> str:
        """Serve in a background thread (own event loop); return the base URL."""
        from infra.gateway.endpoints import build_app

        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted connections only when
        # the listening socket says TCP (proto 0 leaves Nagle on: ~40 ms per response).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            build_app(self),
            log_level="warning",
            access_log=False,
            lifespan="off",
            http="h11",
            ws="none",
            timeout_keep_alive=60,
        )
        self._server = uvicorn.Server(config)
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            ready.set()
            try:
                loop.run_until_complete(self._server.serve(sockets=[sock]))
            finally:
                loop.run_until_complete(self._close_clients())
                loop.close()

        self._thread = threading.Thread(target=run, name="gyre-gateway", daemon=True)
        self._thread.start()
        ready.wait(timeout)
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"gateway on {self.host}:{self.port} did not start")
            time.sleep(0.01)
        self.url = f"http://{self.host}:{self.port}"
        pending, self._pending_engines = self._pending_engines, []
        for cell_id, base_url in pending:
            self.add_engine(cell_id, base_url)
        return self.url

    def stop(self, *, flush: bool = True) -> None:
        """Stop serving. ``flush=False`` leaves unflushed records in the WAL (as a crash would);
        a new Gateway on the same ``spool_dir`` replays them into the store."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
        self._server = self._thread = self._loop = None
        if flush:
            self.tito.close()
        else:
            self.tito.abandon()
        self._keys_fh.close()

    @property
    def openai_base_url(self) -> str:
        """What a harness passes to ``openai.OpenAI(base_url=...)`` (with its session key)."""
        if self.url is None:
            raise RuntimeError("the gateway is not running; call start() first")
        return self.url + "/v1"

    def flush(self) -> None:
        """Write every acknowledged TITO record to the store now."""
        self.tito.flush()

    def __enter__(self) -> Gateway:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _in_loop(self, coro, timeout: float | None = None):
        if self._loop is None:
            raise RuntimeError("the gateway is not running; call start() first")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _close_clients(self) -> None:
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

    # -- engines -------------------------------------------------------------------------
    def add_engine(self, cell_id: str, base_url: str) -> None:
        """Route new sessions to this engine too (probes it first when the gateway runs)."""
        if self._loop is None:
            self._pending_engines.append((cell_id, base_url))
            return
        self._in_loop(self._add_engine(cell_id, base_url), timeout=60)

    async def _add_engine(self, cell_id: str, base_url: str) -> None:
        h = self.router.add(cell_id, base_url)
        try:
            await self.router.client(h)
        except EngineError:
            del self.router.engines[cell_id]
            raise

    def remove_engine(self, cell_id: str, *, drain_timeout: float = 60.0) -> dict:
        """Withdraw a cell: it takes no new calls; in-flight calls finish (or, after
        ``drain_timeout``, are aborted and continue elsewhere from their partial output); its
        sessions move to other cells with their KV when both engines support it."""
        return self._in_loop(self._withdraw(cell_id, drain_timeout), timeout=drain_timeout + 600)

    def engines(self) -> dict:
        return self.router.info()

    def end_session(self, session_id: str) -> None:
        """The session's rollout is over: its cell stops counting it, so placement ignores it
        and a withdrawal of the cell moves no KV for it (its calls stay readable)."""
        if self._loop is not None:
            self._in_loop(self._end_session(session_id), timeout=30)

    async def _end_session(self, session_id: str) -> None:
        s = self.sessions.get(session_id)
        h = self.router.engines.get(s.cell_id) if s is not None and s.cell_id else None
        if h is not None:
            h.sessions.discard(session_id)

    async def _withdraw(self, cell_id: str, drain_timeout: float) -> dict:
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
        moves_before = (self.router.kv_moves, self.router.kv_moved_tokens, self.router.reprefills)
        moved = 0
        for sid in list(h.sessions):
            s = self.sessions.get(sid)
            if s is not None and s.cell_id == cell_id and self.router.active():
                await self._relocate(s, h)
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

    async def _relocate(self, s: Session, old: EngineHandle) -> None:
        async with s.lock:
            if s.cell_id != old.cell_id:
                return
            new = self.router.pick_new(exclude={old.cell_id})
            if s.last_request_id is not None and old.state != "dead":
                with s.state_lock:
                    ctx = s.calls.context(s.last_request_id).tolist()
                await self.router.move_kv(old, new, ctx)
            self.router.assign(s.session_id, new, old)
            s.cell_id = new.cell_id

    async def _cell_for(self, s: Session) -> EngineHandle:
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
        h = self.router.engines.get(str(s.meta.get("cell_id") or ""))
        return h if h is not None and h.state == "active" else None

    def max_context(self) -> int | None:
        limits = [h.max_context for h in self.router.active() if h.max_context]
        return min(limits) if limits else None

    # -- the call pipeline ---------------------------------------------------------------
    def session_calls(self, s: Session) -> SessionCalls:
        """The session's call index (rebuilt from the store after a gateway restart)."""
        if s.session_id in self._restore_pending:
            self._restore_pending.discard(s.session_id)
            self._restore(s)
            if not self._restore_pending:
                self._restore_table = None
        return s.calls

    async def prepare(self, s: Session, build, *args) -> ChatInput:
        """``build(calls, *args)`` under the session's state lock; on a worker thread once the
        session is large (templating and hashing a ~1M-token context take tens of ms, which
        would otherwise stall every other session on the event loop)."""
        calls = self.session_calls(s)

        def run() -> ChatInput:
            with s.state_lock:
                return build(calls, *args)

        if s.tokens >= OFFLOAD_TOKENS:
            return await asyncio.to_thread(run)
        return run()

    def budget(self, n_in: int, gp: GenParams, param: str = "messages") -> int:
        """max_new_tokens for a call, or a 400 when the context does not fit the model."""
        if not self.router.active():
            raise ApiError(503, "no rollout engine is available", type="service_unavailable")
        limit = self.max_context()
        if limit and n_in >= limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens; the input has {n_in}.",
                param=param,
                code="context_length_exceeded",
            )
        if gp.max_new_tokens is not None:
            if limit and n_in + gp.max_new_tokens > limit:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {limit} tokens; you requested "
                    f"{n_in + gp.max_new_tokens} ({n_in} input + {gp.max_new_tokens} output).",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            return gp.max_new_tokens
        return min(self.default_max_tokens, limit - n_in) if limit else self.default_max_tokens

    async def generate(
        self,
        s: Session,
        rid: str,
        input_ids: list[int],
        gp: GenParams,
        max_new: int,
        on_tokens=None,
    ) -> GenResult:
        """Run one call on the session's cell; continue elsewhere on withdrawal/abort/death.

        ``on_tokens(output_ids, logprobs)`` (cumulative) is awaited per streamed chunk.
        """
        t0 = time.time()
        out: list[int] = []
        lps: list[float] = []
        version: int | None = None
        cached: int | None = None
        for attempt in range(MAX_ATTEMPTS):
            try:
                h = await self._cell_for(s)
            except NoEngineError as exc:
                raise ApiError(503, str(exc), type="service_unavailable") from exc
            erid = rid if attempt == 0 else f"{rid}-{attempt}"
            sp = gp.sampling_params(max_new - len(out))
            h.inflight[erid] = time.time()
            s.inflight += 1
            try:
                client = await self.router.client(h)
                if on_tokens is None:
                    resp = await client.generate(input_ids + out, sp, rid=erid)
                else:
                    resp = None
                    async for chunk in client.generate_stream(input_ids + out, sp, rid=erid):
                        resp = chunk
                        await on_tokens(out + chunk["output_ids"], lps + _lps(chunk))
                    if resp is None:
                        raise EngineError("stream ended without a response", url=h.base_url)
            except EngineError as exc:
                h.errors += 1
                if exc.status is not None and 400 <= exc.status < 500:
                    raise ApiError(
                        400, f"the engine rejected the request: {exc.server_message}"
                    ) from exc
                self.counters["retries"] += 1
                log.warning(
                    "call %s on %s failed (attempt %d): %s", rid, h.cell_id, attempt + 1, exc
                )
                alive = h.client is not None and await h.client.health()
                if not alive:
                    h.state = "dead"  # unreachable: its sessions re-prefill elsewhere
                continue
            finally:
                h.inflight.pop(erid, None)
                s.inflight -= 1
            meta = resp.get("meta_info") or {}
            new = [int(t) for t in resp.get("output_ids") or []]
            if version is None and (new or attempt == MAX_ATTEMPTS - 1):
                version = parse_weight_version(meta.get("weight_version"))
            if cached is None:
                cached = int(meta.get("cached_tokens") or 0)
            out += new
            lps += _lps(resp)[: len(new)] + [float("nan")] * max(0, len(new) - len(_lps(resp)))
            h.calls += 1
            h.tokens += len(new)
            finish = meta.get("finish_reason") or {"type": "stop"}
            if finish.get("type") == "abort" and len(out) < max_new:
                self.counters["retries"] += 1  # drained or paused: resubmit prefix + partial
                continue
            s.unrecorded += 1  # until record()/settle(): a withdrawal waits for it
            return GenResult(
                out,
                lps,
                finish,
                version if version is not None else -1,
                cached or 0,
                h.cell_id,
                t0,
                time.time(),
                session=s,
            )
        raise ApiError(
            503,
            f"no engine could finish the call after {MAX_ATTEMPTS} attempts",
            type="service_unavailable",
        )

    def trim_stop(self, res: GenResult, stops: list[str]) -> tuple[str, str | None]:
        """Decoded text, cut before the first stop string (output ids/logprobs cut to the token
        that completed it). Returns (text, matched stop or None)."""
        text = self.tok.decode(res.output_ids)
        if not stops or apply_stop(text, stops) is None:
            return text, None
        lo, hi = 1, len(res.output_ids)  # smallest n whose decoding holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if apply_stop(self.tok.decode(res.output_ids[:mid]), stops) is not None:
                hi = mid
            else:
                lo = mid + 1
        res.output_ids = res.output_ids[:lo]
        res.logprobs = res.logprobs[:lo]
        text = self.tok.decode(res.output_ids)
        i = apply_stop(text, stops)
        matched = next(x for x in stops if x and text.startswith(x, i))
        res.finish = {"type": "stop", "matched": matched}
        return text[:i], matched

    def settle(self, res: GenResult | None) -> None:
        """A generated call is recorded, or never will be (error, harness gone)."""
        if res is not None and res.session is not None and not res.recorded:
            res.recorded = True
            res.session.unrecorded -= 1

    async def record(
        self,
        s: Session,
        rid: str,
        seq: int,
        inp: ChatInput,
        res: GenResult,
        endpoint: str,
        reply: bytes | None = None,
    ) -> None:
        """Durably append the call's TITO record, then remember it in the session."""
        rec = TitoRecord(
            run_id=self.run_id,
            session_id=s.session_id,
            request_id=rid,
            seq_no=seq,
            parent_request_id=inp.parent_request_id,
            prefix_len=inp.prefix_len,
            new_input_ids=inp.new_input_ids,
            output_ids=np.asarray(res.output_ids, dtype=np.int32),
            output_logprobs=np.asarray(res.logprobs, dtype=np.float32),
            weight_version=res.weight_version,
            cell_id=res.cell_id,
            finish_reason=res.finish_type,
            cached_tokens=res.cached_tokens,
            t_start=res.t_start,
            t_end=res.t_end,
            endpoint=endpoint,
        )
        try:
            await self.tito.append_async(rec)
            with s.state_lock:
                s.calls.add(
                    rid, seq, inp, rec.output_ids, reply=reply, im_end_id=self.tok.im_end_id
                )
            s.last_request_id = rid
        finally:
            self.settle(res)
        if inp.msg_key is not None and reply is not None:
            line = f"{s.session_id} {rid} {inp.msg_key.hex()} {digest(reply).hex()}\n"
            self._keys_fh.write(line.encode())
            self._keys_fh.flush()
        self.counters["calls"] += 1
        self.counters["tokens_in"] += len(inp.input_ids)
        self.counters["tokens_out"] += len(res.output_ids)
        s.tokens += len(inp.new_input_ids) + len(res.output_ids)

    def _restore(self, s: Session) -> None:
        """Rebuild a journaled session's call index from the store (after a restart)."""
        if self._restore_table is None:  # read once for all journaled sessions
            self._restore_table = self.store.read("tito")
            self._restore_keys = read_key_journal(self._keys_path)
        table = self._restore_table
        mask = pc.and_(
            pc.equal(table["session_id"], s.session_id), pc.equal(table["run_id"], self.run_id)
        )
        keys = self._restore_keys.get(s.session_id, {})
        restore_calls(s, table_to_records(table.filter(mask)), keys, self.tok.im_end_id)

    def stats(self) -> dict:
        """Flat metrics; ``gateway/loop_cpu_s`` is the event-loop thread's CPU time when called
        on the loop (the HTTP endpoint does), else the calling thread's."""
        return {
            "gateway/loop_cpu_s": time.thread_time(),
            **{f"gateway/{k}": v for k, v in self.counters.items()},
            "gateway/sessions": len(self.sessions),
            "gateway/kv_moves": self.router.kv_moves,
            "gateway/kv_moved_tokens": self.router.kv_moved_tokens,
            "gateway/reprefills": self.router.reprefills,
            **{f"tito/{k}": v for k, v in self.tito.stats.items()},
            "engines": self.router.info(),
        }


def _lps(resp: dict) -> list[float]:
    meta = resp.get("meta_info") or {}
    return [
        float(x[0]) if x[0] is not None else float("nan")
        for x in meta.get("output_token_logprobs") or []
    ]
