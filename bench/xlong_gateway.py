"""xLong gateway bench: one chat session of many calls growing ~2K tokens a call through the
real gateway (fsync on) on bench/gateway.py's stub engine; per-call gateway CPU, body bytes
and orjson's parse of the body (the protocol's floor) at points along the session; the gateway
process's resident memory growth per context token (VmRSS from /proc) and the TITO parquet
bytes on the store per unique token.

    .venv/bin/python bench/xlong_gateway.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import gateway as gwb  # noqa: E402  (the stub engine, processes, admin calls)

WORDS = 667  # "log line " x 667: ~2K tokens of user text per call (500 calls: ~1M tokens)
STUB_MAX_CONTEXT = 1_200_000  # what the stub engine advertises (bench/gateway.py --max-context)


def _rss_bytes(pid: int) -> int:
    """Resident set of a process (VmRSS in /proc/PID/status), bytes."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _parquet_bytes(root: str) -> int:
    return sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(root)
        for f in files
        if f.endswith(".parquet")
    )


def measure(quick: bool, prefix_handles: bool) -> dict:
    """Drive one growing session; curves keyed by context tokens at each measured call.
    ``prefix_handles``: the stub answers as the embedded engine (the gateway sends a prefix
    handle + the new ids); else as SGLang (the whole input ids, as JSON, every call)."""
    import httpx
    import orjson

    from infra.engine.tiny_model import make_tiny_model

    calls = 50 if quick else 500
    words = 250 if quick else WORDS
    model = make_tiny_model()
    procs = gwb._Procs(model)
    try:
        form = ["--prefix-handles"] if prefix_handles else []
        stub_url, _ = procs.spawn("--serve-stub", "--max-context", str(STUB_MAX_CONTEXT), *form)
        url, gw_proc = procs.gateway("xlong", stub_url)
        key = gwb._keys(url, 1)[0]
        cl = httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=120)
        msgs: list[dict] = [{"role": "system", "content": "You are a terse agent."}]
        curve = []
        rss0 = out_tokens = 0
        for i in range(calls):
            if curve and curve[-1]["tokens"] + 3 * words + 64 > STUB_MAX_CONTEXT:
                break
            msgs.append({"role": "user", "content": f"page {i}: " + "log line " * words})
            body = orjson.dumps({"model": "gyre", "messages": msgs, "max_tokens": 8})
            parse = []
            for _ in range(3):  # the median of 3: one parse of a few MB is noisy here
                t0 = time.perf_counter()
                orjson.loads(body)
                parse.append(1e3 * (time.perf_counter() - t0))
            parse_ms = statistics.median(parse)
            cpu0 = gwb._admin(url, "GET", "/gyre/stats")["gateway/cpu_s"]
            r = cl.post(url + "/v1/chat/completions", content=body,
                        headers={"content-type": "application/json"})  # fmt: skip
            if r.status_code != 200:
                raise RuntimeError(f"call {i}: {r.status_code} {r.text[:300]}")
            cpu = gwb._admin(url, "GET", "/gyre/stats")["gateway/cpu_s"] - cpu0
            reply = r.json()
            msgs.append(
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""}
            )
            ctx = reply["usage"]["prompt_tokens"]
            out_tokens = reply["usage"]["completion_tokens"]
            rss = _rss_bytes(gw_proc.pid)
            rss0 = rss0 or rss  # after the first call: tokenizer, template, threads warm
            curve.append({"call": i, "tokens": ctx, "cpu_ms": 1e3 * cpu, "body_bytes": len(body),
                          "parse_ms": parse_ms, "rss_mb": rss / 2**20})  # fmt: skip
        rss_growth = _rss_bytes(gw_proc.pid) - rss0
        stats = gwb._admin(url, "GET", "/gyre/stats")
    finally:
        procs.close()  # the gateway flushes its TITO records to the store on exit
    store = os.path.join(procs.tmp, "xlong", "store")
    tito_bytes = _parquet_bytes(store)
    shutil.rmtree(procs.tmp, ignore_errors=True)

    def near(n: int) -> dict:
        """The call nearest ``n`` tokens, its CPU and parse times the medians of the calls
        around it (up to 5: one call's CPU on a shared 2-core machine is noisy)."""
        i = min(range(len(curve)), key=lambda j: abs(curve[j]["tokens"] - n))
        win = curve[max(0, min(i - 2, len(curve) - 5)) : max(0, min(i - 2, len(curve) - 5)) + 5]
        med = {k: statistics.median(c[k] for c in win) for k in ("cpu_ms", "parse_ms")}
        return {**curve[i], **med}

    pts = {n: near(n) for n in (1_000, 10_000, 100_000, 300_000, 1_000_000)}
    last, ten = pts[1_000_000], pts[10_000]
    unique = curve[-1]["tokens"] + out_tokens  # one linear session: every token once
    grown = curve[-1]["tokens"] - curve[0]["tokens"]  # context since the RSS baseline
    return {
        "xlong_gateway_calls": len(curve),
        "xlong_gateway_tokens_max": curve[-1]["tokens"],
        "xlong_gateway_cpu_ms_1m_over_10k": last["cpu_ms"] / max(ten["cpu_ms"], 1e-9),
        "xlong_gateway_cpu_over_parse_1m": last["cpu_ms"] / max(last["parse_ms"], 1e-9),
        "xlong_gateway_resident_bytes_per_token": rss_growth / max(1, grown),
        "xlong_gateway_rss_growth_mb": rss_growth / 2**20,
        "xlong_gateway_tito_bytes_per_token": tito_bytes / max(1, unique),
        "xlong_gateway_tail_parses": stats.get("gateway/chat_tail_parses", 0),
        # inputs built on a worker thread (a branch past OFFLOAD_TOKENS; 0 for a linear one)
        "xlong_gateway_builds_off_loop": stats.get("gateway/builds_off_loop", 0),
        # what the session's own state holds (call index, spine, body memo, ids JSON)
        "xlong_gateway_held_bytes_per_token": stats.get("gateway/session_bytes", 0)
        / max(1, unique),
        "curve": {str(n): p for n, p in pts.items()},
        "curve_all": curve,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = measure(args.quick, prefix_handles=True)
    full_ids = measure(args.quick, prefix_handles=False)
    out["xlong_gateway_engine_form"] = "prefix handle + new ids (the embedded engine)"
    for k, v in list(full_ids.items()):  # the SGLang form: the whole input ids every call
        if k.startswith("xlong_gateway_") and k != "xlong_gateway_calls":
            out[k.replace("xlong_gateway_", "xlong_gateway_sglang_", 1)] = v
    out["curve_sglang"], out["curve_all_sglang"] = full_ids["curve"], full_ids["curve_all"]
    for form, sfx in (("embedded engine (prefix handles)", ""), ("SGLang (whole ids)", "_sglang")):
        print(form)
        for n, p in out["curve" + sfx].items():
            print(f"{n:>9} tokens={p['tokens']:>8} cpu_ms={p['cpu_ms']:7.2f} "
                  f"body={p['body_bytes']:>9} parse_ms={p['parse_ms']:6.2f} rss_mb={p['rss_mb']:7.1f}")  # fmt: skip
    print(json.dumps({k: v for k, v in out.items() if not k.startswith("curve")}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
