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
    """Left-padded KV of the running batch: buffer ``(L, 2, B, H, cap, D)``.

    Row b holds its ``lens[b]`` tokens at columns ``[end - lens[b], end)``. Rebuilt when the
    membership changes; grows (doubling) when ``end`` reaches ``cap``.
    """

    def __init__(self, rows: list[torch.Tensor], like: torch.Tensor):
        # rows: per request KV (L, 2, H, n_b, D)
        self.lens = [r.shape[3] for r in rows]
        self.end = max(self.lens) if rows else 0
        L, _, H, _, D = like.shape
        cap = max(64, int(self.end * 1.25) + 32)
        self.buf = like.new_zeros((L, 2, len(rows), H, cap, D))
        for b, r in enumerate(rows):
            self.buf[:, :, b, :, self.end - r.shape[3] : self.end] = r

    def row(self, b: int) -> torch.Tensor:
        """KV of row b as (L, 2, H, n, D), a copy."""
        return self.buf[:, :, b, :, self.end - self.lens[b] : self.end].clone()

    def ensure_room(self, q: int = 1) -> None:
        if self.end + q <= self.buf.shape[4]:
            return
        L, two, B, H, cap, D = self.buf.shape
        new = self.buf.new_zeros((L, two, B, H, max(2 * cap, self.end + q), D))
        new[:, :, :, :, : self.end] = self.buf[:, :, :, :, : self.end]
        self.buf = new

    def cache(self) -> Cache:
        """A transformers `Cache` whose layers write into this buffer."""
        layers = [
            BatchLayer(self.buf[i, 0], self.buf[i, 1], self.end) for i in range(len(self.buf))
        ]
        return make_cache(layers)

    def attention_mask(self, dtype) -> torch.Tensor:
        """Additive 4D mask (B, 1, 1, end+1) for a one-token step: 0 = attend, min = pad."""
        B = len(self.lens)
        cols = torch.arange(self.end + 1)
        starts = torch.tensor([self.end - n for n in self.lens]).unsqueeze(1)
        mask = torch.zeros((B, self.end + 1), dtype=dtype)
        mask.masked_fill_(cols.unsqueeze(0) < starts, torch.finfo(dtype).min)
        return mask[:, None, None, :]
