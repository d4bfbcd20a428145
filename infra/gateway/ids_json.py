"""A session's input ids as JSON text, encoded once: for engines that take the whole input
every call.

An engine without prefix handles (SGLang over HTTP: ``/generate`` takes ``input_ids`` only as a
JSON list) gets a session's full context on every call, ~4 MB of JSON at 1M tokens, and
orjson's encoding of it costs ~4 ms a call. The session keeps the text of its last call's
input ids; the next call, whose input starts with them (its parent is that call and shares at
least that much), encodes only its new ids and appends. Anything else encodes from scratch.

Pure module: numpy and orjson only.
"""

from __future__ import annotations

import numpy as np
import orjson

from infra.engine_api.client import JsonIds


def _encode(ids: np.ndarray) -> bytes:
    """``1,2,3``: the inside of ids' JSON array."""
    return orjson.dumps(np.ascontiguousarray(ids), option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]


class IdsJsonCache:
    """The JSON text of one call's input ids (``rid``, ``n`` ids), grown in place."""

    def __init__(self) -> None:
        self.rid: str | None = None
        self.n = 0
        self.buf = bytearray()

    def encode(self, rid: str, ids: np.ndarray, parent: str | None, shared: int) -> JsonIds:
        """``ids`` (call ``rid``'s input; its first ``shared`` are ``parent``'s context's) as
        JSON. The result holds the cache's buffer itself: join it (the engine client does, in
        the same synchronous step) before the cache is used again."""
        n = len(ids)
        if rid == self.rid and n == self.n:  # the same call again (a retry on another cell)
            return JsonIds([self.buf], n)
        if parent is None or parent != self.rid or shared < self.n:
            self.buf, self.n = bytearray(), 0  # not a continuation: from scratch
        new = _encode(ids[self.n :])
        if new:
            if self.buf:
                self.buf += b","
            self.buf += new
        self.rid, self.n = rid, n
        return JsonIds([self.buf], n)

    @property
    def nbytes(self) -> int:
        return len(self.buf)
