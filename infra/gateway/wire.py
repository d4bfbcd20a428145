"""OpenAI / SGLang wire shapes for the gateway: request validation and response bodies.

Pure helpers (no I/O): each ``parse_*`` turns a decoded JSON body into a plain request
description or raises ``ApiError`` (rendered as OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}``); each ``*_body`` / ``*_chunk`` builds a
response dict. Unknown request fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

try:
    import orjson

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)

    loads = orjson.loads
    JSONDecodeError: type[Exception] = orjson.JSONDecodeError
except ImportError:  # pragma: no cover
    import json

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    loads = json.loads
    JSONDecodeError = json.JSONDecodeError


class ApiError(Exception):
    """An error answered to the harness in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class GenParams:
    """What the gateway asks of an engine, whatever the endpoint."""

    max_new_tokens: int | None  # None: fill the context up to the gateway default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False

    def sampling_params(self, max_new_tokens: int) -> dict:
        sp: dict[str, Any] = {
            "max_new_tokens": int(max_new_tokens),
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        if self.top_k not in (-1, 0):
            sp["top_k"] = self.top_k
        if self.seed is not None:
            sp["sampling_seed"] = self.seed
        if self.stop:
            sp["stop"] = list(self.stop)  # SGLang stops early; the gateway also trims
        if self.stop_token_ids:
            sp["stop_token_ids"] = list(self.stop_token_ids)
        return sp


def _num(body: dict, key: str, lo: float, hi: float, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise bad(f"'{key}' must be a number in [{lo}, {hi}], got {v!r}", key)
    return float(v)


def _int(body: dict, key: str, lo: int, default: int | None) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise bad(f"'{key}' must be an integer >= {lo}, got {v!r}", key)
    return int(v)


def _stop(v: Any) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list) and all(isinstance(s, str) for s in v) and len(v) <= 16:
        return [s for s in v if s]
    raise bad("'stop' must be a string or a list of strings", "stop")


def parse_openai_params(body: dict, *, chat: bool) -> GenParams:
    """Sampling and output options shared by chat and text completions."""
    if _int(body, "n", 1, 1) != 1:
        raise bad("only n=1 is supported", "n")
    max_tokens = _int(body, "max_completion_tokens", 1, None) if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, None)
    lp = body.get("logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            raise bad("'logprobs' must be a boolean", "logprobs")
        want_lp = bool(lp)
        if _int(body, "top_logprobs", 0, 0):
            raise bad(
                "top_logprobs > 0 is not supported (the sampled token's logprob is)", "top_logprobs"
            )
    else:
        n_lp = _int(body, "logprobs", 0, None)
        if n_lp:
            raise bad("logprobs > 0 (top alternatives) is not supported; use 0", "logprobs")
        want_lp = n_lp is not None
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad("'seed' must be an integer", "seed")
    so = body.get("stream_options") or {}
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    return GenParams(
        max_new_tokens=max_tokens,
        temperature=_num(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_num(body, "top_p", 0.0, 1.0, 1.0),
        top_k=int(_num(body, "top_k", -1, 1e9, -1)),
        seed=seed,
        stop=_stop(body.get("stop")),
        logprobs=want_lp,
        stream=stream,
        include_usage=bool(isinstance(so, dict) and so.get("include_usage")),
    )


def parse_native_params(body: dict) -> GenParams:
    """SGLang ``/generate`` fields (``sampling_params``, ``return_logprob``, ``stream``)."""
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise bad("'sampling_params' must be an object", "sampling_params")
    ids = sp.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise bad("'stop_token_ids' must be a list of integers", "sampling_params.stop_token_ids")
    seed = sp.get("sampling_seed", sp.get("seed"))
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad("'sampling_seed' must be an integer", "sampling_params.sampling_seed")
    return GenParams(
        max_new_tokens=_int(sp, "max_new_tokens", 1, None),
        temperature=_num(sp, "temperature", 0.0, 100.0, 1.0),
        top_p=_num(sp, "top_p", 0.0, 1.0, 1.0),
        top_k=int(_num(sp, "top_k", -1, 1e9, -1)),
        seed=seed,
        stop=_stop(sp.get("stop")),
        stop_token_ids=ids,
        logprobs=bool(body.get("return_logprob", False)),
        stream=bool(body.get("stream", False)),
    )


def check_token_ids(ids: Any, vocab_size: int, param: str) -> list[int]:
    """Validate a list of token ids (vectorised: a 1M-token input costs milliseconds)."""
    if not isinstance(ids, list) or not ids:
        raise bad(f"'{param}' must be a non-empty list of token ids", param)
    try:
        arr = np.asarray(ids)
    except (ValueError, TypeError):
        arr = np.asarray([], dtype=object)
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.size != len(ids):
        bad_tok = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int)), ids[0])
        raise bad(
            f"'{param}' holds an invalid token id {bad_tok!r} (vocabulary size {vocab_size})",
            param,
            "invalid_token_id",
        )
    out = (arr < 0) | (arr >= vocab_size)
    if out.any():
        t = int(arr[int(np.argmax(out))])
        raise bad(
            f"'{param}' holds an invalid token id {t} (vocabulary size {vocab_size})",
            param,
            "invalid_token_id",
        )
    return ids


# -- responses -------------------------------------------------------------------------------


def usage(n_in: int, n_out: int, cached: int) -> dict:
    return {
        "prompt_tokens": n_in,
        "completion_tokens": n_out,
        "total_tokens": n_in + n_out,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def chat_logprobs(token_strs: list[str], lps: list[float]) -> dict:
    return {
        "content": [
            {"token": s, "logprob": float(lp), "bytes": list(s.encode()), "top_logprobs": []}
            for s, lp in zip(token_strs, lps, strict=True)
        ],
        "refusal": None,
    }


def chat_body(
    rid: str,
    model: str,
    content: str | None,
    tool_calls: list[dict],
    finish: str,
    use: dict,
    logprobs: dict | None,
    created: int | None = None,
) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": msg, "logprobs": logprobs, "finish_reason": finish}],
        "usage": use,
    }


def chat_chunk(
    rid: str,
    model: str,
    created: int,
    delta: dict,
    finish: str | None = None,
    logprobs: dict | None = None,
) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
    }


def usage_chunk(rid: str, model: str, created: int, use: dict, *, chat: bool = True) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": use,
    }


def completion_logprobs(token_strs: list[str], lps: list[float]) -> dict:
    offsets, pos = [], 0
    for s in token_strs:
        offsets.append(pos)
        pos += len(s)
    return {
        "tokens": token_strs,
        "token_logprobs": [float(x) for x in lps],
        "top_logprobs": None,
        "text_offset": offsets,
    }


def completion_body(
    rid: str,
    model: str,
    text: str,
    finish: str,
    use: dict | None,
    logprobs: dict | None,
    created: int | None = None,
    *,
    chunk: bool = False,
) -> dict:
    body = {
        "id": rid,
        "object": "text_completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
    }
    if use is not None:
        body["usage"] = use
    return body


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
