"""SGLang adapter: launch a server, check its version, drain requests to another engine.

HTTP and subprocess only — this module never imports sglang (its import needs a CUDA torch).
The verbs mirror the engine's own (slime's habit): `SGLangServer.start/stop`, and `drain`,
which is what a role switch does to the in-flight requests of a leaving rollout cell:

    pause(abort) -> keep each request's partial output -> resubmit prefix + partial elsewhere

SGLang has no API that moves a live request's KV (DESIGN.md §9). `drain(..., move_kv=True)`
adds gyre's KV export/import when both ends are embedded engines (the source answers
``/gyre/kv/export``); against real SGLang it falls back to a re-prefill on the target (or to
HiCache L3 storage shared by both servers, see `SGLangServer(hicache_storage=...)`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from infra.engine_api.client import EngineClient, EngineError

log = logging.getLogger(__name__)

MIN_VERSION = (0, 5, 0)  # the field names and pause/weight APIs gyre relies on (DESIGN.md §9)
MAX_VERSION = (0, 7, 0)  # exclusive: newer releases are untested; pass check_version=False
HICACHE_BACKENDS = ("file", "mooncake", "hf3fs", "nixl")


class UnsupportedSGLangVersion(RuntimeError):
    pass


class SGLangLaunchError(RuntimeError):
    pass


def parse_version(text: str) -> tuple[int, ...] | None:
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", str(text).strip())
    return None if m is None else tuple(int(x or 0) for x in m.groups())


def check_version(version: str) -> str:
    """Accept SGLang MIN_VERSION <= v < MAX_VERSION and gyre's embedded server; else raise."""
    if str(version).startswith("gyre-"):
        return version
    parsed = parse_version(version)
    if parsed is None or not MIN_VERSION <= parsed < MAX_VERSION:
        lo, hi = ".".join(map(str, MIN_VERSION)), ".".join(map(str, MAX_VERSION))
        raise UnsupportedSGLangVersion(
            f"SGLang version {version!r} is not supported: gyre needs {lo} <= version < {hi} "
            "(pause_generation modes, update_weights_from_disk with weight_version, "
            "meta_info.output_token_logprobs). Install a supported sglang, or pass "
            "check_version=False to try anyway."
        )
    return version


def probe_version(base_url: str, timeout: float = 10.0, api_key: str | None = None) -> str:
    """The server's version from ``/version`` or ``/get_server_info``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    for path in ("/version", "/get_server_info"):
        try:
            resp = httpx.get(base_url.rstrip("/") + path, timeout=timeout, headers=headers)
        except httpx.HTTPError:
            continue
        if resp.status_code == 200:
            try:
                version = resp.json().get("version")
            except ValueError:
                continue
            if version:
                return str(version)
    raise UnsupportedSGLangVersion(f"{base_url} reports no version on /version or /get_server_info")


class SGLangServer:
    """One ``python -m sglang.launch_server`` process.

    `hicache_storage`: None (no HiCache), a directory (HiCache with the ``file`` L3 backend
    there: two servers given the same directory share prefix-keyed KV pages), or a backend
    name from `HICACHE_BACKENDS` configured through `extra_args` / its own env vars.
    `module` can name another server with the same command line (tests launch
    ``infra.engine.server``, the embedded engine, this way on CPU).
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        port: int,
        tp: int = 1,
        extra_args: Sequence[str] = (),
        hicache_storage: str | os.PathLike | None = None,
        host: str = "127.0.0.1",
        python: str = sys.executable,
        module: str = "sglang.launch_server",
        log_path: str | os.PathLike | None = None,
        check_version: bool = True,
        api_key: str | None = None,
    ):
        """``api_key``: SGLang's ``--api-key``, every call but ``/health`` must carry it (a
        server bound beyond loopback takes the run's token; `EngineClient(token=)`)."""
        if tp < 1:
            raise ValueError(f"tp={tp}: tensor parallel size must be >= 1")
        self.model_path = str(model_path)
        self.host, self.port, self.tp = host, int(port), int(tp)
        self.extra_args = list(extra_args)
        self.hicache_storage = None if hicache_storage is None else str(hicache_storage)
        self.python, self.module = python, module
        self.log_path = Path(log_path) if log_path else None
        self.check_version = check_version
        self.api_key = api_key
        self.version: str | None = None
        self._proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [self.python, "-m", self.module, "--model-path", self.model_path]
        cmd += ["--host", self.host, "--port", str(self.port), "--tp-size", str(self.tp)]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if self.hicache_storage is not None:
            backend = self.hicache_storage if self.hicache_storage in HICACHE_BACKENDS else "file"
            cmd += [
                "--enable-hierarchical-cache",
                "--hicache-storage-backend",
                backend,
                "--hicache-write-policy",
                "write_through",
                "--page-size",
                "64",
            ]
        return cmd + self.extra_args

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.hicache_storage is not None and self.hicache_storage not in HICACHE_BACKENDS:
            Path(self.hicache_storage).mkdir(parents=True, exist_ok=True)
            env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = self.hicache_storage
        return env

    def start(self, timeout: float = 900.0) -> str:
        """Launch, wait for /health, check the version; returns the base URL."""
        if self._proc is not None:
            raise RuntimeError(f"{self.url} already started")
        cmd = self.command()
        log.info("launching %s", " ".join(cmd))
        out = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = out = open(self.log_path, "ab")  # noqa: SIM115 - lives with the process
        self._proc = subprocess.Popen(
            cmd, env=self.env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self.stop()
                raise SGLangLaunchError(
                    f"{' '.join(cmd)} exited with code {code} before it was healthy"
                    + (f"; see {self.log_path}" if self.log_path else "")
                )
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            self.stop()
            raise SGLangLaunchError(f"{self.url} not healthy after {timeout:.0f}s")
        self.version = probe_version(self.url, api_key=self.api_key)
        if self.check_version:
            try:
                check_version(self.version)
            except UnsupportedSGLangVersion:
                self.stop()
                raise
        return self.url

    def stop(self, timeout: float = 30.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> SGLangServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class Pending:
    """An in-flight generation on the source: what was asked and the task awaiting it."""

    input_ids: list[int]
    sampling_params: dict
    rid: str
    task: asyncio.Future  # resolves to the source's /generate response (aborted or finished)


async def drain(
    client_from: EngineClient,
    client_to: EngineClient,
    pending: Sequence[Pending],
    *,
    move_kv: bool = True,
) -> list[dict]:
    """Move `pending` requests from one engine to another; returns their merged responses.

    The source is paused with mode "abort" (and left paused: it is leaving the rollout role).
    A request that finished before the pause is returned as is. Otherwise its partial output is
    kept and ``input_ids + partial`` is resubmitted on the target with the remaining
    ``max_new_tokens``; the merged response has ``output_ids = partial + continuation`` and
    the logprobs of both parts, ``weight_version`` of the first token, and
    ``meta_info.drained_tokens = len(partial)``. A seeded request continues with a fresh
    draw on the target (the RNG state does not move); greedy output is unchanged by a drain.
    """
    await client_from.pause("abort")
    # A request that reached the source only after the pause waits in its queue: abort it too,
    # or its task would never finish (abort matches by rid prefix, and the source is leaving).
    for p in pending:
        if not p.task.done():
            await client_from.abort(p.rid)
    results: list[dict | None] = [None] * len(pending)

    async def move(i: int, p: Pending) -> None:
        try:
            first = await p.task
        except EngineError as e:  # the source died mid-request: restart it on the target
            log.warning("drain: %s failed on the source (%s); resubmitting whole", p.rid, e)
            first = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}}
        meta = first.get("meta_info", {})
        if (meta.get("finish_reason") or {}).get("type") != "abort":
            results[i] = first
            return
        partial = list(first.get("output_ids", []))
        params = dict(p.sampling_params)
        params["max_new_tokens"] = int(params.get("max_new_tokens", 128)) - len(partial)
        if params["max_new_tokens"] <= 0:
            results[i] = first
            return
        prefix = list(p.input_ids) + partial
        if move_kv:
            await _move_kv(client_from, client_to, prefix)
        second = await client_to.generate(prefix, params, rid=p.rid, return_logprob=True)
        results[i] = _merge(p, first, second, partial)

    await asyncio.gather(*(move(i, p) for i, p in enumerate(pending)))
    return results  # type: ignore[return-value]


async def _move_kv(client_from: EngineClient, client_to: EngineClient, ids: list[int]) -> int:
    """Export the prefix KV from the source and import it on the target, if both support it."""
    try:
        blob = await client_from.export_kv(ids)
        return await client_to.import_kv(blob)
    except EngineError as e:
        if e.status in (404, 405):  # real SGLang: no KV export; re-prefill on the target
            return 0
        log.warning("drain: KV move failed (%s); the target re-prefills", e)
        return 0


def _merge(p: Pending, first: dict, second: dict, partial: list[int]) -> dict:
    m1, m2 = first.get("meta_info", {}), second.get("meta_info", {})
    lps = list(m1.get("output_token_logprobs") or []) + list(m2.get("output_token_logprobs") or [])
    meta = {
        **m2,
        "id": p.rid,
        "prompt_tokens": len(p.input_ids),
        "completion_tokens": len(partial) + len(second.get("output_ids", [])),
        "weight_version": m1.get("weight_version") if partial else m2.get("weight_version"),
        "output_token_logprobs": lps,
        "drained_tokens": len(partial),
    }
    if "output_token_weight_versions" in m1 or "output_token_weight_versions" in m2:
        meta["output_token_weight_versions"] = list(
            m1.get("output_token_weight_versions") or []
        ) + list(m2.get("output_token_weight_versions") or [])
    return {
        "text": first.get("text", "") + second.get("text", ""),
        "output_ids": partial + list(second.get("output_ids", [])),
        "meta_info": meta,
    }
