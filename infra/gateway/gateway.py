"""The gateway: what an agent harness talks to (DESIGN.md §5 "Gateway").

An OpenAI-compatible HTTP server (``/v1/chat/completions`` with tools and streaming,
``/v1/completions``, ``/v1/responses`` and ``GET /v1/responses/{id}``, ``/v1/models``) plus
SGLang's native ``/generate`` for token-level harnesses, in front of any number of engines
reached only through `EngineClient`. For each call it turns messages into token ids with
token exactness (`infra.gateway.chat`), routes the call to a cell with session affinity
(`infra.gateway.router`), and appends a TITO record to a durable `TitoLog` *before* the
response (or the final stream chunk) goes out (`infra.gateway.pipeline`). The OpenAI ``id`` of
a response is the TITO ``request_id``; harnesses report sub-task scores against it on
``POST /gyre/scores``.

Sessions are named by API keys (``Authorization: Bearer <key>``), one per rollout, made by
``Gateway.new_session`` or the admin endpoint ``POST /gyre/sessions``. Cells join and leave at
run time (``add_engine`` / ``remove_engine``): a withdrawn cell's sessions continue on another
cell with their KV moved, and the harness notices nothing. A session created with
``meta={"cell_id": ...}`` starts on that cell while it serves (a scheduler's placement).

Modules, lowest first: `core` (state) + `pipeline` (the call path), `endpoints` (thin HTTP
adapters, one SSE pump in `stream`), `server` (the server thread), and this facade that ties
them together for callers (flows, the CLI, tests).
"""

from __future__ import annotations

from infra.gateway.core import GatewayCore
from infra.gateway.endpoints import GatewayApp
from infra.gateway.server import ServerThread
from storage.store import Store


class Gateway(GatewayCore):
    """`GatewayCore` served over HTTP from a background thread (its own event loop)."""

    def __init__(self, store: Store, *, host: str = "127.0.0.1", port: int = 0, **kw):
        super().__init__(store, **kw)
        self.host = host
        self.port = port
        self.url: str | None = None
        self._server: ServerThread | None = None
        self._pending_engines: list[tuple[str, str]] = []

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> str:
        """Serve in a background thread; return the base URL."""
        self._server = ServerThread(
            GatewayApp(self),
            host=self.host,
            port=self.port,
            name="gyre-gateway",
            on_exit=self.close_clients,
        )
        self.url = self._server.start(timeout)
        self.port = self._server.port
        pending, self._pending_engines = self._pending_engines, []
        for cell_id, base_url in pending:
            self.add_engine(cell_id, base_url)
        return self.url

    def stop(self, *, flush: bool = True) -> None:
        """Stop serving. ``flush=False`` leaves unflushed records in the WAL (as a crash would);
        a new Gateway on the same ``spool_dir`` replays them into the store."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        self.close(flush=flush)

    @property
    def openai_base_url(self) -> str:
        """What a harness passes to ``openai.OpenAI(base_url=...)`` (with its session key)."""
        if self.url is None:
            raise RuntimeError("the gateway is not running; call start() first")
        return self.url + "/v1"

    def __enter__(self) -> Gateway:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- engines (thread-safe: run on the gateway's loop) --------------------------------
    def add_engine(self, cell_id: str, base_url: str) -> None:
        """Route new sessions to this engine too (probes it first when the gateway runs)."""
        if self._server is None:
            self._pending_engines.append((cell_id, base_url))
            return
        self._server.call(self.add_engine_async(cell_id, base_url), timeout=60)

    def remove_engine(
        self, cell_id: str, *, drain_timeout: float = 60.0, targets: dict[str, str] | None = None
    ) -> dict:
        """Withdraw a cell: it takes no new calls; in-flight calls finish (or, after
        ``drain_timeout``, are aborted and continue elsewhere from their partial output); its
        sessions move to other cells with their KV when both engines support it: a group's
        to the cell ``targets`` names for its group id (the scheduler's reroute), others to
        the least-loaded one."""
        if self._server is None:
            raise RuntimeError("the gateway is not running; call start() first")
        return self._server.call(
            self.withdraw(cell_id, drain_timeout, targets), timeout=drain_timeout + 600
        )

    def drop_engine(self, cell_id: str) -> None:
        """The engine's cell is gone: route nothing more to it (its sessions' next calls
        re-prefill on another cell; a call with no cell left waits for one to join)."""
        if self._server is not None:
            self._server.call(self.drop_engine_async(cell_id), timeout=30)

    def end_session(self, session_id: str) -> None:
        """The session's rollout is over: its cell stops counting it, so placement ignores it
        and a withdrawal of the cell moves no KV for it (its calls stay readable)."""
        if self._server is not None:
            self._server.call(self.end_session_async(session_id), timeout=30)
