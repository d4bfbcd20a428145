"""Response wire formats of the gateway: OpenAI chat/completions bodies and stream chunks,
SGLang-native ``/generate`` answers, Server-Sent Events framing.

Pure helpers (no I/O): each builds a dict (or SSE bytes) from what the call pipeline answered.
"""

from __future__ import annotations

import time
from typing import Any

from infra.gateway.wire import dumps


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
    finish: str | None,
    use: dict | None,
    logprobs: dict | None,
    created: int | None = None,
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


def native_body(
    rid: str,
    n_in: int,
    output_ids: list[int],
    logprobs: list[float],
    *,
    text: str,
    finish: dict | None,
    cached_tokens: int,
    weight_version: int,
    cell_id: str,
    with_logprobs: bool,
) -> dict:
    """SGLang's ``/generate`` answer (``finish_reason`` None on a stream's partial chunks)."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": n_in,
        "completion_tokens": len(output_ids),
        "cached_tokens": cached_tokens,
        "weight_version": str(weight_version),
        "cell_id": cell_id,
    }
    if with_logprobs:
        meta["output_token_logprobs"] = [
            [lp, t, None] for lp, t in zip(logprobs, output_ids, strict=True)
        ]
    return {"text": text, "output_ids": output_ids, "meta_info": meta}
