"""The gateway process's memory beyond its sessions: what the TITO writer loads and keeps.

Measured on one session growing to 1M tokens (bench/xlong_gateway.py), the gateway's resident
set grew ~80 MB where its sessions held ~9 MB, in two steps at the first TITO flush:

* **~45 MB of imports, mid-session.** Building the first segment's Arrow arrays makes pyarrow
  import pandas (its "is this a DataFrame?" check), and writing it loads the Parquet writer
  and zstd: about a second of imports holding the GIL, during which no session's call runs.
  `warm_tito_writer` pays that when the gateway is made, before it serves.
* **~20-35 MB of allocators' high-water marks.** pyarrow's default pool (mimalloc) kept what
  the flush thread freed (the segment's arrays, the encoder's buffers), in proportion to the
  largest flush, and glibc's arenas kept the per-call buffers (a 1M-token body arrives as
  ~3 MB of 64-320 KB parts): glibc's dynamic mmap threshold rises to the largest buffer freed
  so far, after which such buffers come from the heap and its top is no longer trimmed.

`bound_allocators` gives Arrow glibc's allocator and fixes glibc's thresholds: a buffer of
1 MB or more is mapped on its own and unmapped when freed; a heap keeps at most 2 MB free at
its top, above the ~1 MB a call's body parts need, so they are reused without page faults
(a 128 KB trim threshold, glibc's default once the mmap threshold is set, re-faulted ~5 MB a
call at 1M tokens). `ReleasingStore` collects the flush thread's Arrow heap after each
segment. Measured (bench/xlong_gateway.py, 1.01M tokens, 2026-12-03): the process grew 17.6-17.9 B
per context token (77.5 before, 30 with Arrow collected from the event loop instead), of
which the session holds 8.6; most of the rest is the event loop thread's glibc arena
(~8 MB at 1M: its per-call buffers among the session's small long-lived objects).

Process-wide settings, as the engine's `return_large_frees_to_os` is: they are what every
thread of the gateway's process gets (in `gyre run`, the driver's).
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from storage.store import Store
from storage.tito import TitoRecord
from storage.tito_log import records_to_table

MMAP_THRESHOLD = 1 << 20  # bytes: a buffer this large is mapped on its own
TRIM_THRESHOLD = 2 << 20  # bytes: free heap top kept (above a call's ~1 MB of body parts)


def bound_allocators() -> bool:
    """Arrow on glibc's allocator, glibc with fixed mmap and trim thresholds (module doc).
    False where there is no glibc (Arrow's pool is left as it is then too)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
        ok = libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD) == 1
        ok = ok and libc.mallopt(m_trim_threshold, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):
        return False
    return ok


def warm_tito_writer() -> None:
    """Load what the first TITO flush would: one one-row segment, written to memory."""
    rec = TitoRecord(
        run_id="warm",
        session_id="warm",
        request_id="warm",
        seq_no=0,
        parent_request_id=None,
        prefix_len=0,
        new_input_ids=np.zeros(1, np.int32),
        output_ids=np.zeros(1, np.int32),
        output_logprobs=np.zeros(1, np.float32),
        weight_version=0,
        cell_id="",
        finish_reason="stop",
        cached_tokens=0,
        t_start=0.0,
        t_end=0.0,
        endpoint="chat",
        request_json=None,
        response_json=None,
    )
    pq.write_table(records_to_table([rec]), pa.BufferOutputStream(), compression="zstd")


class ReleasingStore:
    """The store as the TITO writer sees it: after each segment its ``append`` writes (on the
    writer's flush thread), that thread's unused Arrow memory is given back (mimalloc keeps
    freed pages in the heap of the thread that freed them; a collect from any other thread
    leaves them there). Everything else is the store's own."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.releases = 0

    def append(self, dataset: str, rows):
        try:
            return self._store.append(dataset, rows)
        finally:
            pa.default_memory_pool().release_unused()
            self.releases += 1

    def __getattr__(self, name: str):
        return getattr(self._store, name)
