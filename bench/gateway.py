"""Gateway overhead: its CPU per call against a stub engine, and added latency over a real one.

Two parts, each with the gateway in its own process (as deployed) and a lean load generator
(raw asyncio HTTP/1.1 keep-alive connections, so that the client's own CPU does not crowd the
2 cores; httpx costs ~1.5-10 ms of CPU per call):

* **stub engine** (``gateway_cpu_ms_per_call``, ``gateway_calls_per_s``): a stub that answers
  ``/generate`` instantly (a canned SGLang answer), in its own process, so that engine compute
  cannot hide gateway cost. One gateway process pinned to one core (``os.sched_setaffinity``),
  the stub and the load generator on the other; 64 concurrent sessions of short chat calls
  (templating, parent lookup, engine call, TITO record fsynced before each answer). Reported:
  the gateway process's CPU seconds (all its threads, ``time.process_time``) per call, and
  calls/s with the gateway saturating its core (with its CPU utilisation, to tell whether the
  gateway or the load generator was the limit). Medians over blocks.
* **real engine** (``added_p50_ms_64``, ``added_p99_ms_64``): the same tiny chat call
  (``max_tokens`` 1) sent at 1, 16 and 64 concurrent sessions *direct* (``POST /generate`` to
  the embedded engine with the ids the gateway would send) and *through the gateway*; added =
  gateway - direct percentiles, paths interleaved in blocks so drift hits both alike. ``own``:
  per call, gateway latency minus the engine round trip the gateway measured
  (``x-gyre-engine-ms``).

``--transports http1,aiohttp`` runs one gateway per engine-client transport side by side in
the stub part (blocks alternate), to price the transport in gateway CPU per call.
``--profile PATH`` writes a py-spy profile of the gateway under the stub load.

    python bench/gateway.py [--quick] [--json PATH] [--stub-only] [--transports http1,aiohttp]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ADMIN = "bench-admin"
LEVELS = (1, 16, 64)
STUB_CONC = 64
MSGS = [{"role": "user", "content": "Say one word."}]
TURNS = 8  # stub part: turns per conversation before it starts over


def _pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity") and cpu < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {cpu})


# -- child processes ----------------------------------------------------------------------------


def _serve_gateway(args) -> None:
    """Child: a gateway in front of ``--engine``; prints its URL, runs until stdin closes."""
    _pin(args.cpu)
    from infra.gateway.gateway import Gateway
    from storage.store import Store

    gw = Gateway(
        Store(args.store),
        run_id="bench",
        tokenizer_dir=args.model,
        spool_dir=args.spool,
        admin_token=ADMIN,
        wal_fsync=not args.no_fsync,
        engine_transport=None if args.transport == "default" else args.transport,
    )
    gw.add_engine("e0", args.engine)
    print(gw.start(), flush=True)
    sys.stdin.read()
    gw.stop()


def _serve_engine(args) -> None:
    """Child: the embedded engine on its HTTP server; prints its URL."""
    from infra.engine.engine import Engine
    from infra.engine.server import EngineServer

    engine = Engine(args.model, max_batch_size=64)
    print(EngineServer(engine).start(), flush=True)
    sys.stdin.read()


class _StubEngine(asyncio.Protocol):
    """A stub SGLang server: ``/generate`` answers a canned 2-token reply at once."""

    def __init__(self, answers: dict[bytes, bytes], stream_answer: bytes):
        self.answers = answers
        self.stream_answer = stream_answer
        self.buf = bytearray()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            i = self.buf.find(b"\r\n\r\n")
            if i < 0:
                return
            head = bytes(self.buf[:i]).lower()
            j = head.find(b"content-length:")
            n = (
                int(head[j + 15 : head.find(b"\r\n", j) if head.find(b"\r\n", j) > 0 else None])
                if j >= 0
                else 0
            )
            if len(self.buf) < i + 4 + n:
                return
            body = bytes(self.buf[i + 4 : i + 4 + n])
            del self.buf[: i + 4 + n]
            path = head.split(b" ", 2)[1]
            if path == b"/generate" and b'"stream":true' in body:
                self.transport.write(self.stream_answer)
            else:
                self.transport.write(self.answers.get(path, self.answers[b"404"]))


def _http_answer(body: bytes, status: str = "200 OK", ctype: bytes = b"application/json") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\ncontent-length: {len(body)}\r\n".encode()
        + b"content-type: " + ctype + b"\r\n\r\n" + body
    )  # fmt: skip


def _serve_stub(args) -> None:
    """Child: the stub engine; prints its URL."""
    import socket

    import uvloop

    from infra.gateway.chat import ChatTokenizer

    _pin(args.cpu)
    tok = ChatTokenizer(args.model)
    out = [*tok.encode("Hi"), tok.im_end_id]
    gen = {
        "text": "Hi",
        "output_ids": out,
        "meta_info": {
            "id": "stub",
            "finish_reason": {"type": "stop", "matched": tok.im_end_id},
            "prompt_tokens": 10,
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "weight_version": "0",
            "output_token_logprobs": [[-0.5, t, None] for t in out],
        },
    }
    ctx = int(args.max_context or 32768)  # what the stub advertises (bench/xlong_gateway.py: ~1M)
    info = {"max_context_length": ctx, "vocab_size": tok.vocab_size, "weight_version": "0"}
    if args.prefix_handles:  # answer as the embedded engine: the gateway sends prefix handles
        info["version"] = "gyre-embedded-stub"
    answers = {
        b"/generate": _http_answer(json.dumps(gen).encode()),
        b"/get_model_info": _http_answer(json.dumps(info).encode()),
        b"/get_server_info": _http_answer(json.dumps(info).encode()),
        b"/health": _http_answer(b""),
        b"/abort_request": _http_answer(b'{"success": true}'),
        b"404": _http_answer(b'{"error": {"message": "not found"}}', "404 Not Found"),
    }
    chunk = b"data: " + json.dumps(gen).encode() + b"\n\ndata: [DONE]\n\n"
    stream = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n0\r\n\r\n"
    )  # fmt: skip
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _StubEngine(answers, stream), sock=sock)
        await loop.run_in_executor(None, sys.stdin.read)
        server.close()

    uvloop.run(main())


# -- load generator -----------------------------------------------------------------------------


class _Conn(asyncio.Protocol):
    """One keep-alive client connection; ``call`` sends a prepared request, awaits the answer."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.sent = 0
        self.lost = True

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.lost = False

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is not None and not self.waiter.done():
            got = self._answer()
            if got is not None:
                self.waiter.set_result(got)

    def connection_lost(self, exc) -> None:
        self.lost = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost: {exc!r}"))

    def _answer(self) -> tuple[int, bytes, bytes] | None:
        i = self.buf.find(b"\r\n\r\n")
        if i < 0:
            return None
        head = bytes(self.buf[:i]).lower()
        j = head.find(b"content-length:")
        if j < 0:  # chunked: wait for the last chunk
            k = self.buf.find(b"\r\n0\r\n\r\n", i)
            if k < 0:
                return None
            end = k + 7
        else:
            e = head.find(b"\r\n", j)
            end = i + 4 + int(head[j + 15 : e if e > 0 else None])
            if len(self.buf) < end:
                return None
        body = bytes(self.buf[i + 4 : end])
        del self.buf[:end]
        return int(head[9:12]), head, body

    async def call(self, request: bytes) -> tuple[int, bytes, bytes]:
        for attempt in (0, 1):  # a server may close a keep-alive connection that idled
            if self.lost:
                self.buf.clear()
                loop = asyncio.get_running_loop()
                await loop.create_connection(lambda: self, self.host, self.port)
            self.waiter = asyncio.get_running_loop().create_future()
            self.transport.write(request)
            try:
                return await self.waiter
            except ConnectionError:
                if attempt:
                    raise
        raise AssertionError("unreachable")


def _request(path: str, body: dict, key: str | None) -> bytes:
    data = json.dumps(body).encode()
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST {path} HTTP/1.1\r\nhost: bench\r\n{auth}content-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    ).encode() + data


async def _connect(url: str, n: int) -> list[_Conn]:
    host, port = url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    conns = [_Conn(host, int(port)) for _ in range(n)]
    for c in conns:
        await loop.create_connection(lambda c=c: c, host, int(port))
    return conns


async def _drive(
    conns: list[_Conn], reqs: list[list[bytes]], n: int
) -> tuple[list[float], list[float]]:
    """``n`` calls on each connection, all at once; connection i cycles through ``reqs[i]``.
    Returns (latencies ms, own ms: latency minus the engine time the gateway reported)."""
    lat: list[float] = []
    own: list[float] = []

    async def worker(c: _Conn, seq: list[bytes]) -> None:
        for i in range(n):
            t = time.perf_counter()
            status, head, body = await c.call(seq[(c.sent + i) % len(seq)])
            dt = 1e3 * (time.perf_counter() - t)
            if status != 200:
                raise RuntimeError(f"HTTP {status}: {body[:300]!r}")
            lat.append(dt)
            k = head.find(b"x-gyre-engine-ms:")
            if k >= 0:
                e = head.find(b"\r\n", k)
                own.append(dt - float(head[k + 17 : e if e > 0 else None]))
        c.sent += n

    await asyncio.gather(*(worker(c, r) for c, r in zip(conns, reqs, strict=True)))
    return lat, own


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


# -- orchestration ------------------------------------------------------------------------------


class _Procs:
    def __init__(self, model: str):
        self.model = model
        self.env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
        self.procs: list[subprocess.Popen] = []
        self.tmp = tempfile.mkdtemp(prefix="gyre-bench-gw-")

    def spawn(self, *extra: str) -> tuple[str, subprocess.Popen]:
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--model", self.model, *extra],
                             env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.procs.append(p)
        url = p.stdout.readline().strip()
        if not url:
            raise RuntimeError(f"{' '.join(extra)} exited with {p.wait()}")
        return url, p

    def gateway(self, name: str, engine: str, *extra: str) -> tuple[str, subprocess.Popen]:
        return self.spawn("--serve-gateway", "--engine", engine, "--store", f"{self.tmp}/{name}/store",
                          "--spool", f"{self.tmp}/{name}/spool", *extra)  # fmt: skip

    def close(self) -> None:
        for p in self.procs[::-1]:
            if p.stdin:
                p.stdin.close()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


_HTTP = None


def _admin(url: str, method: str, path: str) -> dict:
    global _HTTP
    import httpx

    if _HTTP is None:
        _HTTP = httpx.Client(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    r = _HTTP.request(method, url + path, json={} if method == "POST" else None)
    r.raise_for_status()
    return r.json()


def _keys(url: str, n: int) -> list[str]:
    return [_admin(url, "POST", "/gyre/sessions")["api_key"] for _ in range(n)]


def _chat_reqs(keys: list[str]) -> list[bytes]:
    """One request per session: a fixed short chat (the real-engine part)."""
    body = {"model": "gyre", "messages": MSGS, "max_tokens": 1, "temperature": 0}
    return [_request("/v1/chat/completions", body, k) for k in keys]


def _agent_reqs(url: str, conn: int, calls: int, turns: int = TURNS) -> list[bytes]:
    """``calls`` requests of one connection as agent harnesses make them against the stub
    (whose reply is always "Hi"): conversations of ``turns`` calls, each on a new session;
    each turn sends the conversation so far + the reply + a new user message, so every call
    extends the previous one token-exactly (a template render of the new messages, parent
    lookup, delta encoding)."""
    out: list[bytes] = []
    for c in range(-(-calls // turns)):
        key = _keys(url, 1)[0]
        msgs = [{"role": "system", "content": "You are a terse agent."},
                {"role": "user", "content": f"Task {conn}.{c}: say one word."}]  # fmt: skip
        for t in range(turns):
            body = {"model": "gyre", "messages": msgs, "max_tokens": 8, "temperature": 0}
            out.append(_request("/v1/chat/completions", body, key))
            msgs = [*msgs, {"role": "assistant", "content": "Hi"},
                    {"role": "user", "content": f"Turn {t + 1} of task {conn}.{c}: again."}]  # fmt: skip
    return out[:calls]


def _py_spy() -> str:
    """py-spy on PATH, or beside this Python (a venv's bin/ need not be on PATH)."""
    found = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if not found:
        raise SystemExit("--profile needs py-spy: pip install py-spy")
    return found


def stub_part(procs: _Procs, transports: list[str], quick: bool, profile: str | None) -> dict:
    """Gateway CPU per call and calls/s on one core, against the stub engine."""
    two = (os.cpu_count() or 1) >= 2
    gw_cpu, other_cpu = ("0", "1") if two else (None, None)
    stub_url, _ = procs.spawn("--serve-stub", *(["--cpu", other_cpu] if two else []))
    _pin(int(other_cpu) if two else None)
    blocks, per_conn = (3, 2 * TURNS) if quick else (5, 8 * TURNS)
    gws = {}
    for t in transports:
        extra = ["--transport", t, *(["--cpu", gw_cpu] if two else [])]
        url, p = procs.gateway(f"stub-{t}", stub_url, *extra)
        n = (2 + blocks) * per_conn  # warm-up + measured calls per connection
        gws[t] = (url, p, [_agent_reqs(url, i, n) for i in range(STUB_CONC)])
    res: dict[str, list[tuple[float, float, float]]] = {t: [] for t in transports}
    lat: dict[str, list[float]] = {t: [] for t in transports}

    async def run() -> None:
        conns = {t: await _connect(u, STUB_CONC) for t, (u, _, _) in gws.items()}
        for t, (url, _, reqs) in gws.items():  # warm, up to the first Parquet segment
            await _drive(conns[t], reqs, 2 * per_conn)
            deadline = time.monotonic() + 30
            while not _admin(url, "GET", "/gyre/stats")["tito/segments"]:
                if time.monotonic() > deadline:
                    raise RuntimeError("the gateway wrote no TITO segment within 30 s")
                await asyncio.sleep(0.1)
        spy = None
        if profile:  # py-spy samples the first gateway over the measured blocks
            pid = str(gws[transports[0]][1].pid)
            spy = subprocess.Popen([_py_spy(), "record", "-o", profile, "-f", "raw", "-p", pid,
                                    "-r", "250", "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        for b in range(blocks):
            for t in transports if b % 2 == 0 else transports[::-1]:
                url, _, reqs = gws[t]
                cpu0 = _admin(url, "GET", "/gyre/stats")["gateway/cpu_s"]
                t0 = time.perf_counter()
                ls, _ = await _drive(conns[t], reqs, per_conn)
                wall = time.perf_counter() - t0
                cpu = _admin(url, "GET", "/gyre/stats")["gateway/cpu_s"] - cpu0
                n = STUB_CONC * per_conn
                res[t].append((1e3 * cpu / n, n / wall, cpu / wall))
                lat[t] += ls
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
        for cs in conns.values():
            for c in cs:
                c.transport.close()

    asyncio.run(run())
    out: dict = {}
    for t in transports:
        sfx = "" if t == transports[0] else f"_{t}"
        out[f"gateway_cpu_ms_per_call{sfx}"] = statistics.median(r[0] for r in res[t])
        out[f"gateway_calls_per_s{sfx}"] = statistics.median(r[1] for r in res[t])
        out[f"gateway_cpu_utilisation{sfx}"] = statistics.median(r[2] for r in res[t])
        out[f"stub_p50_ms_64{sfx}"] = _pct(lat[t], 0.5)
        out[f"stub_p99_ms_64{sfx}"] = _pct(lat[t], 0.99)
        out[f"stub_calls{sfx}"] = len(lat[t])
    st = _admin(gws[transports[0]][0], "GET", "/gyre/stats")
    out["stub_tito_fsyncs"], out["stub_tito_records"] = st["tito/fsyncs"], st["tito/appended"]
    out["transport"] = transports[0]
    return out


def engine_part(procs: _Procs, ids: list[int], quick: bool) -> dict:
    """Added latency of the gateway over direct calls to the real embedded engine."""
    rounds, warm, blocks = (2, 1, 1) if quick else (40, 2, 2)
    engine_url, _ = procs.spawn("--serve-engine")
    paths: dict[str, tuple[str, list[list[bytes]]]] = {}
    sp = {"max_new_tokens": 1, "temperature": 0}
    direct = _request(
        "/generate", {"input_ids": ids, "sampling_params": sp, "return_logprob": True}, None
    )
    paths["direct"] = (engine_url, [[direct]] * max(LEVELS))
    for name, extra in (("gateway", ()), ("gateway_nofsync", ("--no-fsync",))):
        url, _ = procs.gateway(name, engine_url, *extra)
        paths[name] = (url, [[r] for r in _chat_reqs(_keys(url, max(LEVELS)))])
    out: dict = {}

    async def level(conc: int) -> None:
        conns = {n: await _connect(u, conc) for n, (u, _) in paths.items()}
        lat: dict[str, list[float]] = {n: [] for n in paths}
        own: dict[str, list[float]] = {n: [] for n in paths}
        for n in paths:
            await _drive(conns[n], paths[n][1][:conc], warm)
        order = list(paths)
        for b in range(blocks):  # alternate so that drift hits every path alike
            for n in order if b % 2 == 0 else order[::-1]:
                ls, os_ = await _drive(conns[n], paths[n][1][:conc], max(1, rounds // blocks))
                lat[n] += ls
                own[n] += os_
        d50, d99 = _pct(lat["direct"], 0.5), _pct(lat["direct"], 0.99)
        for n in paths:
            out[f"{n}_p50_ms_{conc}"] = _pct(lat[n], 0.5)
            out[f"{n}_p99_ms_{conc}"] = _pct(lat[n], 0.99)
            if n != "direct":
                sfx = n.removeprefix("gateway")
                out[f"added{sfx}_p50_ms_{conc}"] = out[f"{n}_p50_ms_{conc}"] - d50
                out[f"added{sfx}_p99_ms_{conc}"] = out[f"{n}_p99_ms_{conc}"] - d99
                out[f"own{sfx}_p50_ms_{conc}"] = _pct(own[n], 0.5)
                out[f"own{sfx}_p99_ms_{conc}"] = _pct(own[n], 0.99)
        out[f"n_{conc}"] = len(lat["direct"])
        for cs in conns.values():
            for c in cs:
                c.transport.close()

    for conc in LEVELS:
        asyncio.run(level(conc))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer calls (< 1 min)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--stub-only", action="store_true", help="only the stub-engine part")
    ap.add_argument("--transports", default="default",
                    help="engine-client transports to run side by side in the stub part, "
                         "e.g. http1,aiohttp (default: the client's default)")  # fmt: skip
    ap.add_argument("--profile", default=None, help="py-spy profile of the gateway (stub part)")
    for hidden in ("--serve-gateway", "--serve-engine", "--serve-stub", "--no-fsync",
                   "--prefix-handles"):  # fmt: skip
        ap.add_argument(hidden, action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--engine", "--model", "--store", "--spool", "--transport", "--cpu",
                   "--max-context"):  # fmt: skip
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.cpu = int(args.cpu) if args.cpu is not None else None
    args.transport = args.transport or "default"
    if args.serve_gateway:
        _serve_gateway(args)
        return {}
    if args.serve_engine:
        _serve_engine(args)
        return {}
    if args.serve_stub:
        _serve_stub(args)
        return {}
    if args.profile:  # before anything starts
        _py_spy()

    from infra.engine.tiny_model import make_tiny_model
    from infra.gateway.chat import ChatTokenizer

    model = make_tiny_model()
    tok = ChatTokenizer(model)
    ids = tok.encode(tok.render(MSGS, None, True))
    transports = args.transports.split(",")
    out: dict = {}
    procs = _Procs(model)
    try:
        out.update(stub_part(procs, transports, args.quick, args.profile))
    finally:
        procs.close()
    if not args.stub_only:
        _pin(None)
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
        procs = _Procs(model)
        try:
            out.update(engine_part(procs, ids, args.quick))
        finally:
            procs.close()

    print("stub engine, 64 concurrent sessions, one gateway process on one core:")
    print(
        f"{'transport':<12}{'CPU ms/call':>12}{'calls/s':>10}{'gw CPU use':>12}{'p50 ms':>9}{'p99 ms':>9}"
    )
    for t in transports:
        sfx = "" if t == transports[0] else f"_{t}"
        print(f"{t:<12}{out['gateway_cpu_ms_per_call' + sfx]:>12.3f}{out['gateway_calls_per_s' + sfx]:>10.0f}"
              f"{out['gateway_cpu_utilisation' + sfx]:>12.0%}{out['stub_p50_ms_64' + sfx]:>9.2f}"
              f"{out['stub_p99_ms_64' + sfx]:>9.2f}")  # fmt: skip
    cpu, qps = out["gateway_cpu_ms_per_call"], out["gateway_calls_per_s"]
    print(f"targets: CPU per call <= 0.5 ms {'met' if cpu <= 0.5 else 'NOT met'} ({cpu:.3f}); "
          f"calls/s >= 2000 {'met' if qps >= 2000 else 'NOT met'} ({qps:.0f})")  # fmt: skip
    if not args.stub_only:
        print("\nreal engine (added = through the gateway - direct to the engine):")
        print(f"{'metric (ms)':<26}" + "".join(f"{f'{c} sessions':>14}" for c in LEVELS))
        for key in ("direct_p50", "direct_p99", "gateway_p50", "gateway_p99", "added_p50",
                    "added_p99", "own_p50", "own_p99", "added_nofsync_p50", "added_nofsync_p99"):  # fmt: skip
            print(f"{key:<26}" + "".join(f"{out[f'{key}_ms_{c}']:>14.2f}" for c in LEVELS))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return out


if __name__ == "__main__":
    main()
