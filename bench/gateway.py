"""Gateway overhead: added latency of gateway + TITO recording over a direct engine call.

Side by side in one run, at 1, 16 and 64 concurrent sessions: the same tiny call (a short
chat, ``max_tokens`` 1 so that engine time is small) sent

* **direct**: ``POST /generate`` to the engine with the token ids the gateway would send;
* **gateway**: ``POST /v1/chat/completions`` through the gateway (templating, parent lookup,
  routing, TITO record fsynced before the answer).

Engine, gateway and the load generator run as three processes (as in a deployment; one
process would put all three behind one GIL). Reported per concurrency level: p50/p99 of both
paths, ``added_p50/p99 = gateway - direct`` percentiles, and ``own_p50/p99``: per request, the
gateway's end-to-end latency minus the engine round trip the gateway itself measured (header
``x-gyre-engine-ms``) — the gateway's own cost, free of engine-time noise.

``--compare-httpx`` adds a path ``gateway_httpx``: the same gateway with its `EngineClient`
on the former httpx transport, side by side with the default raw-asyncio one (`infra.engine_api.http1`).

    python bench/gateway.py [--quick] [--compare-httpx] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ADMIN = "bench-admin"
LEVELS = (1, 16, 64)


def _serve_gateway(args) -> None:
    """Child process: a gateway in front of the engine; prints its URL, runs until stdin ends."""
    from infra.gateway.gateway import Gateway
    from storage.store import Store

    if args.httpx_client:  # the former transport, for --compare-httpx
        import httpx

        import infra.gateway.router
        from infra.engine_api.client import EngineClient

        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        infra.gateway.router.EngineClient = lambda url: EngineClient(
            url, transport=httpx.AsyncHTTPTransport(limits=limits)
        )
    gw = Gateway(
        Store(args.store),
        run_id="bench",
        tokenizer_dir=args.model,
        spool_dir=args.spool,
        admin_token=ADMIN,
        wal_fsync=not args.no_fsync,
    )
    gw.add_engine("e0", args.engine)
    print(gw.start(), flush=True)
    sys.stdin.read()
    gw.stop()


def _serve_engine(args) -> None:
    """Child process: the embedded engine's own app (``engine_server.build_app``) on uvicorn.

    Served here rather than via ``EngineServer`` only to bind with ``IPPROTO_TCP`` (asyncio
    then sets TCP_NODELAY on connections); see the report in bench output.
    """
    import socket

    import uvicorn

    from infra.engine.engine import Engine
    from infra.engine.server import build_app

    engine = Engine(args.model, max_batch_size=64)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    cfg = uvicorn.Config(build_app(engine), log_level="warning", access_log=False, lifespan="off")
    uvicorn.Server(cfg).run(sockets=[sock])


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def _run_level(
    paths: dict, ids: list[int], conc: int, rounds: int, warm: int, blocks: int = 2
) -> dict:
    """Each path's latencies at ``conc`` concurrent sessions, paths interleaved in blocks."""
    import httpx

    # keepalive_expiry under uvicorn's 5 s idle close: a path's connections idle through the
    # other paths' blocks, and reusing one as the server closes it resets the call.
    limits = httpx.Limits(
        max_connections=conc + 8, max_keepalive_connections=conc + 8, keepalive_expiry=2.0
    )
    lat: dict[str, list[float]] = {name: [] for name in paths}
    own: dict[str, list[float]] = {name: [] for name in paths}
    msgs = [{"role": "user", "content": "Say one word."}]
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:

        async def one(name: str, w: int, record: bool) -> None:
            url, keys = paths[name]
            t = time.perf_counter()
            if keys is None:
                sp = {"max_new_tokens": 1, "temperature": 0}
                body = {"input_ids": ids, "sampling_params": sp, "return_logprob": True}
                r = await http.post(url + "/generate", json=body)
            else:
                body = {"model": "gyre", "messages": msgs, "max_tokens": 1, "temperature": 0}
                auth = {"Authorization": f"Bearer {keys[w]}"}
                r = await http.post(url + "/v1/chat/completions", json=body, headers=auth)
            dt = (time.perf_counter() - t) * 1e3
            r.raise_for_status()
            if record:
                lat[name].append(dt)
                if keys is not None:
                    own[name].append(dt - float(r.headers["x-gyre-engine-ms"]))

        async def worker(name: str, w: int, n: int) -> None:
            for i in range(-warm, n):
                await one(name, w, i >= 0)

        order = list(paths)
        for block in range(blocks):  # alternate so that drift hits every path alike
            for name in order if block % 2 == 0 else order[::-1]:
                await asyncio.gather(*(worker(name, w, rounds // blocks) for w in range(conc)))
    out = {}
    d50, d99 = _pct(lat["direct"], 0.5), _pct(lat["direct"], 0.99)
    for name in paths:
        out[f"{name}_p50_ms"] = _pct(lat[name], 0.5)
        out[f"{name}_p99_ms"] = _pct(lat[name], 0.99)
        if name != "direct":
            sfx = name.removeprefix("gateway")
            out[f"added{sfx}_p50_ms"] = out[f"{name}_p50_ms"] - d50
            out[f"added{sfx}_p99_ms"] = out[f"{name}_p99_ms"] - d99
            out[f"own{sfx}_p50_ms"] = _pct(own[name], 0.5)
            out[f"own{sfx}_p99_ms"] = _pct(own[name], 0.99)
    out["n"] = len(lat["direct"])
    return out


def _logic_us_per_call(model: str, n: int = 400) -> float:
    """CPU of the gateway's own per-call logic without HTTP: messages -> ids (template, parent
    lookup), output parsing, TITO frame encoding and the session index update."""
    import numpy as np

    from infra.gateway.chat import (
        ChatTokenizer,
        SessionCalls,
        build_chat_input,
        normalize_messages,
        parse_output,
        reply_key,
    )
    from infra.gateway.wire import chat_body, dumps, usage
    from storage.tito import TitoRecord
    from storage.tito_log import encode_frame

    tok = ChatTokenizer(model)
    calls = SessionCalls()
    out = np.asarray(tok.encode("Hello there.") + [tok.im_end_id], dtype=np.int32)
    body = {"model": "gyre", "messages": [{"role": "user", "content": "Say one word."}]}
    t = time.thread_time()
    for i in range(n):
        msgs = normalize_messages(body["messages"])
        inp = build_chat_input(tok, calls, msgs, None)
        content, tcs = parse_output(tok.decode(out))
        rec = TitoRecord("bench", "s", f"r{i}", i, inp.parent_request_id, inp.prefix_len,
                         inp.new_input_ids, out, np.zeros(len(out), np.float32), 0)  # fmt: skip
        encode_frame(rec)
        calls.add(f"r{i}", i, inp, out, reply=reply_key(content, tcs), im_end_id=tok.im_end_id)
        dumps(chat_body(f"r{i}", "gyre", content, tcs, "stop", usage(10, 3, 0), None))
    return 1e6 * (time.thread_time() - t) / n


def _loop_cpu(url: str) -> float:
    import httpx

    auth = {"Authorization": f"Bearer {ADMIN}"}
    return float(httpx.get(url + "/gyre/stats", headers=auth).json()["gateway/loop_cpu_s"])


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (< 1 min)")
    ap.add_argument("--rounds", type=int, default=None, help="calls per session per path")
    ap.add_argument("--json", default=None)
    ap.add_argument("--serve-gateway", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve-engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--compare-httpx",
        action="store_true",
        help="also run a gateway whose engine client uses httpx (the former transport)",
    )
    ap.add_argument("--no-fsync", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--httpx-client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--spool", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_gateway:
        _serve_gateway(args)
        return {}
    if args.serve_engine:
        _serve_engine(args)
        return {}

    import httpx

    from infra.engine.tiny_model import make_tiny_model
    from infra.gateway.chat import ChatTokenizer

    rounds = args.rounds or (2 if args.quick else 40)
    warm = 1 if args.quick else 2
    blocks = 1 if args.quick else 2
    model = make_tiny_model()
    tok = ChatTokenizer(model)
    ids = tok.encode(tok.render([{"role": "user", "content": "Say one word."}], None, True))
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    tmp = tempfile.mkdtemp(prefix="gyre-bench-gw-")
    me = [sys.executable, os.path.abspath(__file__)]
    procs: list[subprocess.Popen] = []

    def spawn(*extra: str) -> subprocess.Popen:
        p = subprocess.Popen([*me, *extra], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
        procs.append(p)
        return p

    def url_of(p: subprocess.Popen) -> str:
        url = p.stdout.readline().strip()
        _wait_http(url, p)
        return url

    def keys_of(url: str) -> list[str]:
        auth = {"Authorization": f"Bearer {ADMIN}"}
        return [
            httpx.post(url + "/gyre/sessions", json={}, headers=auth).json()["api_key"]
            for _ in range(max(LEVELS))
        ]

    try:
        engine_url = url_of(spawn("--serve-engine", "--model", model))
        paths = {"direct": (engine_url, None)}
        variants = [("gateway", ()), ("gateway_nofsync", ("--no-fsync",))]
        if args.compare_httpx:
            variants.append(("gateway_httpx", ("--httpx-client",)))
        gws = {
            name: spawn("--serve-gateway", "--engine", engine_url, "--model", model,
                        "--store", f"{tmp}/{name}/store", "--spool", f"{tmp}/{name}/spool", *extra)
            for name, extra in variants
        }  # fmt: skip
        for name, p in gws.items():  # both start at once
            url = url_of(p)
            paths[name] = (url, keys_of(url))
        results = {}
        for c in LEVELS:
            cpu0 = {n: _loop_cpu(u) for n, (u, k) in paths.items() if k is not None}
            results[c] = asyncio.run(_run_level(paths, ids, c, rounds, warm, blocks))
            for n, (u, k) in paths.items():  # the gateway loop thread's CPU per call
                if k is not None:
                    sfx = n.removeprefix("gateway")
                    calls = c * (rounds // blocks + warm) * blocks
                    results[c][f"cpu{sfx}_per_call_ms"] = 1e3 * (_loop_cpu(u) - cpu0[n]) / calls
        auth = {"Authorization": f"Bearer {ADMIN}"}
        stats = httpx.get(paths["gateway"][0] + "/gyre/stats", headers=auth).json()
    finally:
        for p in procs[::-1]:
            if p.stdin:
                p.stdin.close()
            p.terminate()
            p.wait(30)

    logic_us = _logic_us_per_call(model)
    cols = [c for c in results[LEVELS[0]] if c != "n"]
    print(f"{'metric (ms)':<26}" + "".join(f"{f'{c} sessions':>14}" for c in LEVELS))
    for c in cols:
        print(f"{c.removesuffix('_ms'):<26}" + "".join(f"{results[k][c]:>14.2f}" for k in LEVELS))
    print(f"{'calls per path':<26}" + "".join(f"{results[k]['n']:>14d}" for k in LEVELS))
    print(f"gateway logic without HTTP (template, parent lookup, parse, TITO frame): "
          f"{logic_us:.0f} us CPU per call")  # fmt: skip
    out: dict = {"rounds": rounds, "tito_fsyncs": stats.get("tito/fsyncs"),
                 "tito_records": stats.get("tito/appended"), "logic_us_per_call": logic_us}  # fmt: skip
    for conc, r in results.items():
        for c, v in r.items():
            out[f"{c.removesuffix('_ms')}_ms_{conc}" if c != "n" else f"n_{conc}"] = v
    ok = out["added_p99_ms_64"] <= 2.0
    print(
        f"target added p99 <= 2 ms at 64 sessions: {'met' if ok else 'NOT met'} "
        f"(fsynced WAL: added p99 {out['added_p99_ms_64']:.2f} ms, own p99 "
        f"{out['own_p99_ms_64']:.2f} ms; no-fsync WAL: added p99 "
        f"{out['added_nofsync_p99_ms_64']:.2f} ms, own p99 {out['own_nofsync_p99_ms_64']:.2f} ms)"
    )
    if args.compare_httpx:  # same run, same engine: the engine client's share
        print(
            f"{'engine client (ms)':<18}" + "".join(f"{f'{c}: http1 / httpx':>24}" for c in LEVELS)
        )
        for head, tail in (("added", "p50"), ("added", "p99"), ("own", "p50"), ("own", "p99"),
                           ("cpu", "per_call")):  # fmt: skip
            print(f"{head + '_' + tail:<18}" + "".join(
                f"{out[f'{head}_{tail}_ms_{c}']:>12.2f} / {out[f'{head}_httpx_{tail}_ms_{c}']:<9.2f}"
                for c in LEVELS
            ))  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return out


if __name__ == "__main__":
    main()
