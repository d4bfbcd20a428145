"""The gateway process's allocator settings and TITO-writer warm-up (infra/gateway/memory.py),
in a fresh interpreter each (they are process-wide)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

ROOT = __file__.rsplit("/tests/", 1)[0]


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ROOT},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_warm_up_loads_what_the_first_flush_would_so_that_it_imports_nothing():
    got = _run(
        """
        import sys, tempfile
        from infra.gateway.memory import warm_tito_writer
        from storage.store import Store
        from storage.tito_log import records_to_table
        from tests.infra.gateway.test_memory import _record
        store = Store(tempfile.mkdtemp())
        before = "pandas" in sys.modules
        warm_tito_writer()
        mods = set(sys.modules)
        store.append("tito", records_to_table([_record()]))
        print(before, sorted(set(sys.modules) - mods))
        """
    )
    assert got == "False []"  # pandas (pyarrow's DataFrame check) and the writer: loaded before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_two_megabyte_buffer_is_unmapped():
    got = _run(
        """
        from infra.gateway.memory import bound_allocators
        def rss():
            return next(int(l.split()[1]) for l in open("/proc/self/status")
                        if l.startswith("VmRSS")) * 1024
        assert bound_allocators()
        del bytearray(8 << 20)[:]  # glibc's default: its mmap threshold would rise to 8 MB
        keep = [bytearray(2 << 20) for _ in range(20)]  # 40 MB: 2 MB each, above 1 MB: mapped
        pin = bytearray(200 << 10)  # a heap block after them: the heap's top cannot shrink
        up = rss()
        del keep
        print(round((up - rss()) / 2**20))
        """
    )
    assert int(got) >= 38


_FLUSHES = """
    import queue, tempfile, threading
    import pyarrow as pa
    from infra.gateway.memory import ReleasingStore
    from storage.store import Store
    from storage.tito_log import records_to_table
    from tests.infra.gateway.test_memory import _record
    def rss():
        return next(int(l.split()[1]) for l in open("/proc/self/status")
                    if l.startswith("VmRSS")) * 1024
    plain = Store(tempfile.mkdtemp())
    store = ReleasingStore(plain) if RELEASE else plain
    recs = [_record(2000) for _ in range(300)]  # 2.4 MB of ids a segment
    store.append("tito", records_to_table(recs[:1]))  # the writer loaded
    todo, done = queue.Queue(), queue.Queue()
    def flusher():  # one long-lived thread, as TitoLog's
        while todo.get():
            store.append("tito", records_to_table(recs))
            done.put(1)
    threading.Thread(target=flusher, daemon=True).start()
    base = rss()
    for _ in range(3):
        todo.put(1)
        done.get()
    print(round((rss() - base) / 2**20), len(store.segments("tito")),
          getattr(store, "releases", 0))
"""


def test_the_flush_threads_arrow_memory_is_given_back_after_each_segment():
    kept, n, releases = map(int, _run(_FLUSHES.replace("RELEASE", "True")).split())
    plain, n_plain, _ = map(int, _run(_FLUSHES.replace("RELEASE", "False")).split())
    assert (n, n_plain, releases) == (4, 4, 4)  # the store's own segments() through it
    assert kept <= 4 and plain >= kept + 10, (kept, plain)  # MB, after 3 segments


def _record(n: int = 5):
    import numpy as np

    from storage.tito import TitoRecord

    return TitoRecord(
        run_id="r",
        session_id="s",
        request_id="q",
        seq_no=0,
        parent_request_id=None,
        prefix_len=0,
        new_input_ids=np.arange(n, dtype=np.int32),
        output_ids=np.arange(2, dtype=np.int32),
        output_logprobs=np.zeros(2, np.float32),
        weight_version=0,
        cell_id="c",
        finish_reason="stop",
        cached_tokens=0,
        t_start=0.0,
        t_end=0.0,
        endpoint="chat",
        request_json="{}",
        response_json=None,
    )
