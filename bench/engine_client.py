"""`EngineClient` cost per call, per transport: gyre's raw-asyncio HTTP/1.1 pool, aiohttp, httpx.

A stub engine (Starlette on uvicorn, in a child process, answering ``/generate`` with a canned
SGLang-shaped response and ``/health``) takes the calls, so what is measured is the client: the
client process's CPU per call (``time.thread_time``, the event loop's own cost; uvloop, as in
the gateway) and calls/s, at 1 and 64 concurrent callers. Transports alternate in blocks
(medians over blocks), so drift hits all alike. ``httpx`` is the same `EngineClient` with
``transport=httpx.AsyncHTTPTransport`` (what every call went through before
`infra.engine_api.http1`); ``aiohttp`` is ``transport="aiohttp"``.

    python bench/engine_client.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import uvloop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

IDS = list(range(100, 140))  # a short chat's worth of prompt tokens
SP = {"max_new_tokens": 1, "temperature": 0}


def _serve_stub() -> None:
    """Child process: the stub engine; prints its URL."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    answer = {
        "text": "Hi",
        "output_ids": [9707],
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": len(IDS),
            "completion_tokens": 1,
            "cached_tokens": len(IDS) - 1,
            "weight_version": "0",
            "output_token_logprobs": [[-0.25, 9707, None]],
        },
    }

    async def generate(request):
        await request.body()
        return JSONResponse(answer)

    async def health(request):
        return Response(b"", 200)

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"]),
                            Route("/health", health)])  # fmt: skip
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")).run(
        sockets=[sock]
    )


def _client(kind: str, url: str):
    import httpx

    from infra.engine_api.client import EngineClient

    if kind in ("http1", "aiohttp"):
        return EngineClient(url, transport=kind)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    return EngineClient(url, transport=httpx.AsyncHTTPTransport(limits=limits))


async def _block(kind: str, url: str, op: str, conc: int, n: int) -> tuple[float, float]:
    """(client CPU µs per call, calls/s) for ``n`` calls per caller at ``conc`` callers."""
    async with _client(kind, url) as c:

        async def call() -> None:
            if op == "generate":
                await c.generate(IDS, SP, rid="bench")
            else:
                assert await c.health()

        await asyncio.gather(*(call() for _ in range(conc)))  # open the connections

        async def caller() -> None:
            for _ in range(n):
                await call()

        t, cpu = time.perf_counter(), time.thread_time()
        await asyncio.gather(*(caller() for _ in range(conc)))
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - t
    return 1e6 * cpu / (n * conc), n * conc / wall


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--serve-stub", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_stub:
        _serve_stub()
        return {}
    blocks, calls = (3, 200) if args.quick else (7, 600)
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve-stub"], env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    out: dict = {}
    try:
        url = p.stdout.readline().strip()
        time.sleep(0.5)
        kinds = ("httpx", "http1", "aiohttp")
        for op, conc in (("health", 1), ("generate", 1), ("generate", 64)):
            res: dict = {k: [] for k in kinds}
            for b in range(blocks):
                for k in kinds if b % 2 == 0 else kinds[::-1]:
                    res[k].append(uvloop.run(_block(k, url, op, conc, max(1, calls // conc))))
            for k in kinds:
                out[f"{op}_c{conc}/{k}_us_per_call"] = statistics.median(r[0] for r in res[k])
                out[f"{op}_c{conc}/{k}_calls_per_s"] = statistics.median(r[1] for r in res[k])
    finally:
        p.terminate()
        p.wait(30)
    print(f"{'op, callers':<18}" + "".join(f"{k + ' us/call':>16}" for k in kinds)
          + "".join(f"{k + ' calls/s':>16}" for k in kinds))  # fmt: skip
    for key in sorted({k.split("/")[0] for k in out}):
        print(f"{key:<18}" + "".join(f"{out[f'{key}/{k}_us_per_call']:>16.0f}" for k in kinds)
              + "".join(f"{out[f'{key}/{k}_calls_per_s']:>16.0f}" for k in kinds))  # fmt: skip
    print("us/call: client process CPU per call (medians over blocks); calls/s: wall-clock,")
    print("with the stub server's own CPU on the same 2 cores")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return out


if __name__ == "__main__":
    main()
