"""``gyre serve`` and ``gyre session new``: the gateway and an engine for a user's own harness.

A served run is durable like a ``gyre run``: the gateway's write-ahead log and
session-key journal live in a stable place per store and run id
(``storage.paths.spool_dir``), so stopping the server (Ctrl-C, SIGTERM, or a crash)
and starting it again on the same store replays every answered call into the store
and keeps old session keys working. Each server leaves a record per port
(``storage.paths.serve_records_dir()/<port>.json``, mode 0600, it holds the admin
token); a live server's record is never overwritten, and ``gyre session new`` finds the
one live server or asks which. A record is removed only when its server is provably
gone (its process is not alive, nothing listens on its port, or its run's lease says
so): a server too busy to answer within a few seconds keeps its record and is reported
as not answering.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from storage.paths import RunIdError, check_run_id, serve_records_dir, spool_dir

DEFAULT_SERVE_RUN_ID = "serve"
log = logging.getLogger(__name__)


class ServeError(RuntimeError):
    """A serve command cannot go on; the message says what to do."""


@dataclass(frozen=True)
class ServeRecord:
    url: str
    admin_token: str
    store: str
    run_id: str
    pid: int
    port: int
    host: str = ""  # where the server runs (records before this field: this host)

    @property
    def path(self) -> Path:
        return serve_records_dir() / f"{self.port}.json"


HEALTH_TIMEOUT_S = 3.0  # a server that takes longer to answer /health is "not answering"
_HOST = socket.gethostname()


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's process: alive
        pass
    return False


def _lease_says_gone(rec: ServeRecord) -> bool | None:
    """Whether the lease of the record's run says its server is gone (the lease is free:
    released, expired, or its holder's process is gone; or another process holds it now);
    None when the lease cannot be read (the store is not there or does not answer)."""
    from storage.lease import holder
    from storage.store import Store, StoreError

    try:
        got = holder(Store(rec.store, create=False, retry_s=5.0), rec.run_id)
    except (StoreError, OSError, ValueError) as exc:
        log.warning(
            "serve record %s: cannot read the lease of run %s: %s", rec.path, rec.run_id, exc
        )
        return None
    if got is None:
        return True
    return not (int(got.get("pid", -1)) == rec.pid and got.get("host") == (rec.host or _HOST))


def _state(rec: ServeRecord, timeout: float) -> str:
    """``live`` (answers /health), ``gone`` (provably: its process is not alive, nothing
    listens on its port, or its run's lease says so) or ``silent`` (alive by the lease, or
    not known to be gone, but not answering within ``timeout``: busy, or stuck). A record
    is removed only when gone: a server busy for a while keeps its record, and ``gyre
    session new`` says it does not answer."""
    if rec.host not in ("", _HOST):
        return "elsewhere"  # its pid and port mean nothing here
    if _pid_gone(rec.pid):
        return "gone"
    try:
        if httpx.get(f"{rec.url}/health", timeout=timeout).status_code == 200:
            return "live"
    except httpx.ConnectError:  # refused: nothing listens on its port (a live server does,
        return "gone"  # even when its event loop is busy: the kernel accepts for it)
    except httpx.HTTPError:
        pass
    return "gone" if _lease_says_gone(rec) else "silent"


def scan_records(timeout: float = HEALTH_TIMEOUT_S) -> tuple[list[ServeRecord], list[ServeRecord]]:
    """(servers that answer, servers alive but not answering); records of gone ones (and
    unreadable records) are removed."""
    live, silent = [], []
    for f in sorted(serve_records_dir().glob("*.json")):
        try:
            rec = ServeRecord(**json.loads(f.read_text()))
        except (OSError, ValueError, TypeError):
            f.unlink(missing_ok=True)
            continue
        state = _state(rec, timeout)
        if state == "live":
            live.append(rec)
        elif state == "silent":
            silent.append(rec)
        elif state == "gone":
            f.unlink(missing_ok=True)
    return live, silent


def live_records() -> list[ServeRecord]:
    """Records of servers that answer; records of gone ones are removed."""
    return scan_records()[0]


def _silent(rec: ServeRecord) -> str:
    return (
        f"the gyre serve at {rec.url} (pid {rec.pid}, store {rec.store}) is running but did "
        f"not answer /health within {HEALTH_TIMEOUT_S:.0f} s (busy, or stuck); its record "
        f"{rec.path} is kept"
    )


def _write_record(rec: ServeRecord) -> None:
    rec.path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(rec.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(asdict(rec), fh)


def _stop_on_signals() -> threading.Event:
    """SIGINT and SIGTERM both end the server cleanly, also when a non-interactive shell
    started it in the background with SIGINT ignored (``gyre serve &``)."""
    stop = threading.Event()

    def handler(signum, frame) -> None:
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


def _preflight(model: str | None, port: int) -> None:
    """Refuse a busy port or a model that is not a checkpoint at once, both together,
    before torch and the engine are imported (which took up to a minute under load)."""
    from flows.preflight import check_model_dir, check_port

    live, silent = scan_records()
    for rec in live:
        if rec.port == port:
            raise ServeError(
                f"a gyre serve already answers at {rec.url} (pid {rec.pid}, store {rec.store}); "
                "stop it or pick another --port"
            )
    for rec in silent:
        if rec.port == port:
            raise ServeError(f"{_silent(rec)}; stop it (kill {rec.pid}) or pick another --port")
    problems = []
    if model is not None and (why := check_model_dir(model)) is not None:
        problems.append(
            f"--model {model}: {why}; give a Hugging Face checkpoint directory, or leave "
            "--model out to serve the tiny model"
        )
    if (why := check_port(port)) is not None:
        problems.append(f"--port {port}: {why}; pick another --port")
    if problems:
        raise ServeError("; ".join(problems))


def serve(
    model: str | None,
    store_url: str,
    port: int,
    run_id: str | None,
    max_body_mb: int | None = None,
) -> int:
    _preflight(model, port)
    from storage.lease import Lease
    from storage.store import Store

    stop = _stop_on_signals()
    run_id = run_id or DEFAULT_SERVE_RUN_ID
    try:
        check_run_id(run_id)  # it names the spool directory, which holds session keys
    except RunIdError as exc:
        raise ServeError(f"--run-id: {exc}") from None
    store = Store(store_url)
    # one writer per run: a second `gyre serve` (or a `gyre run`) of this run id is refused
    with Lease(store, run_id, f"gyre serve (port {port})", on_lost=stop.set):
        return _serve(model, store, port, run_id, stop, max_body_mb)


def served_version(store, run_id: str, engine, model_dir: str) -> int:
    """The committed version of ``run_id`` whose weights the engine loaded, newest first,
    by weights digest (never by the directory's name or a default): every answer is
    recorded with it. A version stored without a digest (a copied model) gets one,
    computed from its files. Raises ServeError when the weights are none of the run's."""
    from storage.checkpoints import fetch_checkpoint, put_digest, stored_digest, versions

    digest = engine.weights_digest()
    dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
    have = versions(store, run_id)
    for v in reversed(have):
        got = stored_digest(store, run_id, v)
        if got is None:
            got = _digest_of(fetch_checkpoint(store, run_id, v), dtype)
            put_digest(store, run_id, v, got, dtype)
        if got == digest:
            return v
    raise ServeError(
        f"--model {model_dir}: its weights are none of run {run_id!r}'s committed versions "
        f"(v{have[0]}..v{have[-1]}), so its answers would be recorded under the wrong "
        "version: serve a checkpoint of this run (its store's checkpoints/<run>/v<N>), or "
        "give a new --run-id"
    )


def _digest_of(ckpt_dir: str, dtype: str) -> str:
    """The weights digest of a local checkpoint loaded as the engine loads it (``dtype``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from storage.checkpoints import weights_digest

    model = AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=getattr(torch, dtype))
    return weights_digest(model)


def _serve(
    model: str | None,
    store,
    port: int,
    run_id: str,
    stop: threading.Event,
    max_body_mb: int | None = None,
) -> int:
    """The server's life, while this process holds the run's lease. Each phase before the
    banner says what it does and how long it took (under load the imports and the weights
    take a minute: the log is never silent meanwhile)."""
    import secrets

    t0 = time.monotonic()

    def say(what: str) -> None:
        print(f"gyre serve: {what} ({time.monotonic() - t0:.1f}s)", flush=True)

    say("importing torch and transformers")
    from infra.engine.engine import Engine
    from infra.engine.server import EngineServer
    from infra.engine.tiny_model import make_tiny_model
    from infra.gateway.core import MAX_BODY_BYTES
    from infra.gateway.gateway import Gateway
    from storage.checkpoints import publish_checkpoint, put_digest, versions

    model_dir = model or make_tiny_model()
    say(f"loading {model_dir}")
    engine = Engine(model_dir, cell_id="serve")
    if not versions(store, run_id):  # the run's v0: the tokenizer its tokens decode with,
        say(f"publishing it as run {run_id}'s v0 in {store.url}")
        publish_checkpoint(store, run_id, model_dir, 0)  # and where --from-served starts
        dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
        put_digest(store, run_id, 0, engine.weights_digest(), dtype)
    say("matching its weights to the run's versions (digest)")
    engine.name_version(served_version(store, run_id, engine, model_dir))
    server = EngineServer(engine)
    token = secrets.token_urlsafe(24)
    spool = spool_dir(store.url, run_id)
    say(f"starting the gateway (tokenizer, replay of {spool})")
    gw = Gateway(
        store,
        run_id=run_id,
        tokenizer_dir=model_dir,
        admin_token=token,
        port=port,
        spool_dir=str(spool),
        max_body_bytes=MAX_BODY_BYTES if max_body_mb is None else max_body_mb << 20,
    )
    rec = None
    try:
        engine_url = server.start()
        url = gw.start()
        gw.add_engine("serve", engine_url)
        rec = ServeRecord(url, token, store.url, run_id, os.getpid(), port, _HOST)
        _write_record(rec)
        print(f"gyre serve: model {model_dir}")
        print(f"  base URL     {url}/v1   (OpenAI-compatible; native /generate at {url}/generate)")
        print(
            f"  model name   {gw.model_name}   (send model={gw.model_name!r}; other names get 404)"
        )
        print(f"  store        {store.url}  (run_id {run_id}; log of answered calls in {spool})")
        print("  session key  gyre session new      (prints a session id and its API key)")
        print(f"  admin token  in {rec.path} (gyre session new reads it there)")
        print(f"  score        POST {url}/gyre/scores with the session's key, e.g. "
              '{"subtask_id": "answer", "score": 1.0}')  # fmt: skip
        print(f"  train        stop this server, then gyre run --from-served {run_id} "
              f"--store {store.url}")  # fmt: skip
        print(f'  inspect      gyre sql --store {store.url} "SELECT * FROM calls"   '
              "(rows appear within ~2 s of an answer: the log flushes every 2 s)")  # fmt: skip
        print("Ctrl-C or SIGTERM to stop.", flush=True)
        stop.wait()
        print("gyre serve: stopping (flushing answered calls to the store)", flush=True)
    finally:
        if rec is not None:
            rec.path.unlink(missing_ok=True)
        gw.stop()
        server.stop()
    return 0


def new_session(url: str | None, admin_token: str | None, port: int | None) -> dict:
    """Mint a session on a running server: the one given, or the only live one."""
    if url is None or admin_token is None:
        live, silent = scan_records()
        recs = [r for r in live if port is None or r.port == port]
        quiet = [r for r in silent if port is None or r.port == port]
        if not recs and quiet:
            raise ServeError(
                "; ".join(_silent(r) for r in quiet)
                + ": try again in a while, or pass --url and --admin-token (its record holds "
                "the token)"
            )
        if not recs:
            raise ServeError(
                "no running `gyre serve` found"
                + (f" on port {port}" if port is not None else "")
                + "; start one, or pass --url and --admin-token"
            )
        if len(recs) > 1:
            listed = ", ".join(f"{r.url} (store {r.store})" for r in recs)
            raise ServeError(f"several `gyre serve` are running: {listed}; pass --port")
        url, admin_token = url or recs[0].url, admin_token or recs[0].admin_token
    try:
        r = httpx.post(
            f"{url}/gyre/sessions",
            json={},
            timeout=30,
            headers={"Authorization": f"Bearer {admin_token}"},
        )
    except httpx.HTTPError as exc:
        raise ServeError(f"the gateway at {url} does not answer ({exc}); is it running?") from exc
    if r.status_code != 200:
        raise ServeError(f"the gateway at {url} refused: {r.status_code} {r.text}")
    body = r.json()
    return {
        "session_id": body["session_id"],
        "api_key": body["api_key"],
        "base_url": f"{url}/v1",
        "model": "gyre",  # the model name the gateway serves (infra/gateway/core.py)
        "scores_url": f"{url}/gyre/scores",
    }


def main_serve(args) -> int:
    from storage.lease import LeaseHeld

    try:
        return serve(args.model, args.store, args.port, args.run_id, args.max_body_mb)
    except (ServeError, LeaseHeld) as exc:
        print(f"gyre serve: {exc}", file=sys.stderr)
        return 2


def main_session(args) -> int:
    try:
        print(json.dumps(new_session(args.url, args.admin_token, args.port), indent=2))
    except ServeError as exc:
        print(f"gyre session new: {exc}", file=sys.stderr)
        return 2
    return 0
