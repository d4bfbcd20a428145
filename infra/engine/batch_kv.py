"""The running batch's KV: one left-padded buffer that transformers' attention reads and writes.

Continuous batching decodes requests of different lengths in one forward. Each request's KV is
a row of a ``(L, 2, B, H_kv, cap, D)`` buffer, right-aligned so every row ends at the same
column ``end``; the new token of every row is written at ``end`` and an additive mask hides
the left padding. Positions (RoPE) come from each request's true length, so a padded row
computes exactly what the request would compute alone (up to float summation order).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


def make_cache(layers) -> Cache:
    return Cache(layers=layers)


class BatchLayer:
    """One layer's view of the batch KV buffer, speaking transformers' cache-layer protocol.

    Writes the step's new keys/values at column ``end`` (same for every row: rows are
    left-padded so they all end there) and returns views up to the new end.
    """

    is_sliding = False
    is_compileable = False
    is_initialized = True

    def __init__(self, k: torch.Tensor, v: torch.Tensor, end: int):
        self.buf_k, self.buf_v, self.end = k, v, end  # (B, H, cap, D)

    @property
    def keys(self):
        return self.buf_k[:, :, : self.end]

    @property
    def values(self):
        return self.buf_v[:, :, : self.end]

    def update(self, key_states, value_states, *args, **kwargs):
        q = key_states.shape[-2]
        self.buf_k[:, :, self.end : self.end + q] = key_states
        self.buf_v[:, :, self.end : self.end + q] = value_states
        self.end += q
        return self.buf_k[:, :, : self.end], self.buf_v[:, :, : self.end]

    def get_seq_length(self) -> int:
        return self.end

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.end + query_length, 0

    def get_max_length(self) -> int:
        return -1


class BatchKV:
    """Left-padded KV of the running batch: buffer ``(L, 2, rows, H, cap, D)``.

    Row b holds its ``lens[b]`` tokens at columns ``[end - lens[b], end)``; rows past
    ``len(lens)`` are free slots. Joining and leaving copy one row, not the batch: a new row
    goes into the next free slot, a leaving row is replaced by the last one (so row order is
    not stable: the engine permutes its request list the same way). The buffer is re-laid
    out only when it must grow (more rows, longer rows, more columns) or when the left
    padding has grown past half of it.
    """

    def __init__(self, like: torch.Tensor):
        self.shape = like.shape  # (L, 2, H, n, D) of one row
        self.buf: torch.Tensor | None = None
        self.lens: list[int] = []
        self.end = 0

    def __len__(self) -> int:
        return len(self.lens)

    def _layout(self, rows: int, end: int, cap: int) -> None:
        """Copy the live rows into a fresh buffer with `rows` slots ending at column `end`."""
        L, _, H, _, D = self.shape
        old, old_end = self.buf, self.end
        self.buf = old.new_zeros((L, 2, rows, H, cap, D))
        for b, n in enumerate(self.lens):
            self.buf[:, :, b, :, end - n : end] = old[:, :, b, :, old_end - n : old_end]
        self.end = end

    def add(self, kv: torch.Tensor) -> None:
        """Append a row with KV ``(L, 2, H, n, D)``."""
        n = kv.shape[3]
        if self.buf is None:
            L, _, H, _, D = kv.shape
            self.buf = kv.new_zeros((L, 2, 4, H, max(64, int(n * 1.25) + 32), D))
            self.end = n
        rows = self.buf.shape[2]
        need_rows = len(self.lens) + 1
        if need_rows > rows or n > self.end:
            end = max(self.end, n)
            cap = max(self.buf.shape[4], int(end * 1.25) + 32)
            self._layout(2 * rows if need_rows > rows else rows, end, cap)
        b = len(self.lens)
        self.buf[:, :, b, :, : self.end - n] = 0
        self.buf[:, :, b, :, self.end - n : self.end] = kv
        self.lens.append(n)

    def remove(self, b: int) -> torch.Tensor:
        """Drop row b, returning its KV (a copy); the last row moves into slot b."""
        kv = self.row(b)
        last = len(self.lens) - 1
        if b != last:
            self.buf[:, :, b, :, : self.end] = self.buf[:, :, last, :, : self.end]
            self.lens[b] = self.lens[last]
        self.lens.pop()
        if self.lens and max(self.lens) < self.end // 2 and self.end > 256:
            self._layout(self.buf.shape[2], max(self.lens), self.buf.shape[4])  # trim padding
        return kv

    def row(self, b: int) -> torch.Tensor:
        """KV of row b as (L, 2, H, n, D), a copy."""
        return self.buf[:, :, b, :, self.end - self.lens[b] : self.end].clone()

    def ensure_room(self, q: int = 1) -> None:
        if self.end + q > self.buf.shape[4]:
            self._layout(self.buf.shape[2], self.end, max(2 * self.buf.shape[4], self.end + q))

    def advance(self, q: int = 1) -> None:
        """Account for `q` tokens written at ``end`` in every row by a forward."""
        self.end += q
        self.lens = [n + q for n in self.lens]

    def cache(self) -> Cache:
        """A transformers `Cache` over the live rows, writing into this buffer."""
        B = len(self.lens)
        return make_cache(
            [
                BatchLayer(self.buf[i, 0, :B], self.buf[i, 1, :B], self.end)
                for i in range(len(self.buf))
            ]
        )

    def attention_mask(self, dtype) -> torch.Tensor:
        """Additive 4D mask (B, 1, 1, end+1) for a one-token step: 0 = attend, min = pad."""
        B = len(self.lens)
        cols = torch.arange(self.end + 1)
        starts = torch.tensor([self.end - n for n in self.lens]).unsqueeze(1)
        mask = torch.zeros((B, self.end + 1), dtype=dtype)
        mask.masked_fill_(cols.unsqueeze(0) < starts, torch.finfo(dtype).min)
        return mask[:, None, None, :]


def prefill_mask(past: list[int], new: list[int], dtype) -> torch.Tensor:
    """Additive mask ``(B, 1, Q, P + Q)`` of a batched prefill: 0 = attend, min = not.

    Row b holds its ``past[b]`` cached tokens at columns ``[P - past[b], P)`` and its
    ``new[b]`` tokens at ``[P + Q - new[b], P + Q)`` (``P = max(past)``, ``Q = max(new)``);
    query j is column ``P + j``. A new token attends to its row's cached tokens and, causally,
    to its new ones; a padding query to itself only (a finite row, never read).
    """
    P, Q = max(past), max(new)
    n = torch.tensor(past).view(-1, 1, 1)
    m = torch.tensor(new).view(-1, 1, 1)
    col = torch.arange(P + Q).view(1, 1, -1)
    q = torch.arange(Q).view(1, -1, 1)
    cached = (col >= P - n) & (col < P)  # (B, 1, P+Q)
    fresh = (col >= P + Q - m) & (col <= P + q)  # (B, Q, P+Q)
    allowed = torch.where(q >= Q - m, cached | fresh, col == P + q)  # (B, Q, P+Q)
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]
