"""Rollout cells SIGKILLed mid-session, on the real stack: a LocalCluster of cells (worker
processes under nannies), engines on them, the gateway, the executor, and agent harnesses
on the official openai client (on threads of this process, so that a killed cell takes only
its engine, not the harnesses: the Prefect flow's case, where harnesses die with their
worker and Dask reruns them, is tests/faults/test_run_faults.py).

Killed: first one of two rollout cells (its sessions' next calls go to the other cell and
re-prefill there), then the only rollout cell left (calls wait for a cell to serve again).
What must survive: every harness session finishes with no error, TITO holds exactly the
calls each harness made, once, in order; each lost cell is taken over by the worker its
nanny restarts, with its role (an engine serving the newest weights), recorded in ``cells``.
"""

from __future__ import annotations

import itertools
import os
import secrets
import signal
import time

import pytest

from infra.cells.cluster import start_cells
from infra.cells.executor import EngineSpec, Executor
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.gateway import Gateway
from storage.checkpoints import publish_checkpoint
from storage.store import Store
from tasks.sched.coordinator import Move, MoveDone, RolloutFinished, StartRollouts
from tests.infra.cells.test_switch import ThreadWork, _wait

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.slow]


def _wait_calls(gw: Gateway, cell_id: str, n: int, timeout: float = 120) -> None:
    """Until the engine of ``cell_id`` answered ``n`` calls and still holds live sessions."""
    deadline = time.monotonic() + timeout
    while True:
        info = gw.engines().get(cell_id, {})
        if info.get("calls", 0) >= n and info.get("sessions", 0) > 0:
            return
        assert time.monotonic() < deadline, f"{cell_id} served {info} within {timeout}s"
        time.sleep(0.05)


def _kill(cells, addr: str) -> None:
    os.kill(cells.pids()[addr], signal.SIGKILL)


def _healed(ex: Executor, seen: list, n: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while ex.stats.cells_healed < n:
        assert time.monotonic() < deadline, f"no heal within {timeout}s: {ex.stats}"
        seen += ex.events(timeout=0.5)


def test_rollout_cells_killed_mid_session_lose_no_call(tmp_path):
    store = Store(str(tmp_path / "store"))
    run_id = "killed"
    model_dir = make_tiny_model()
    publish_checkpoint(store, run_id, model_dir, 0)
    publish_checkpoint(store, run_id, model_dir, 1)  # what a healed cell must serve
    t0 = time.monotonic()
    with start_cells(2, threads_per_cell=2, rollout_slots=4, harness_slots=4) as cells:
        gw = Gateway(
            store,
            run_id=run_id,
            tokenizer_dir=model_dir,
            admin_token=secrets.token_urlsafe(8),
            spool_dir=str(tmp_path / "spool"),
        )
        gw.start()
        work = ThreadWork(gw, store, run_id)
        engine = EngineSpec(model_dir=model_dir, decode_step_s=0.03, prefill_tokens_per_s=20000)
        ex = Executor(
            cells, gw, store, run_id, work, engine, version=1, drain_timeout_s=30, watch_s=0.2
        )
        try:
            ex.start(("rollout", "rollout"), "test: initial roles")
            seen: list = []
            for d in (StartRollouts(0, 2), StartRollouts(1, 2)):
                ex.apply(d, "test")
            # A: one of two rollout cells dies; its sessions continue on the other
            victim_a = ex.addrs[1]
            dead_a = ex.cell_id(1)
            _wait_calls(gw, dead_a, 3)
            _kill(cells, victim_a)
            _healed(ex, seen, 1)
            assert ex.addrs[1] != victim_a and cells.roles[ex.addrs[1]] == "rollout"
            assert ex.engine_version[1] == 1  # the newest weights, before any call
            assert gw.engines()[ex.cell_id(1)]["state"] == "active"
            assert gw.engines()[dead_a]["state"] == "dead"
            # B: the only rollout cell left dies; calls wait for a cell to serve again
            ex.apply(Move(1, "train", reroute=((0, 2),)), "test: cell 1 trains")
            _wait(ex, seen, lambda e: isinstance(e, MoveDone) and e.cell == 1)
            ex.apply(StartRollouts(0, 2), "test: more sessions")
            victim_b = ex.addrs[0]
            dead_b = ex.cell_id(0)
            n0 = gw.engines()[dead_b]["calls"]
            _wait_calls(gw, dead_b, n0 + 3)
            _kill(cells, victim_b)
            _healed(ex, seen, 2)
            assert ex.addrs[0] != victim_b and cells.roles[ex.addrs[0]] == "rollout"
            _wait(ex, seen, lambda e: sum(isinstance(x, RolloutFinished) for x in seen) == 6)
            stats = gw.stats()
        finally:
            ex.close()
            gw.stop()
    wall = time.monotonic() - t0
    sessions = [h for g in ex.groups.values() for h in g.sessions]
    assert len(sessions) == 12
    assert all(h.status == "finished" for h in sessions), [(h.status, h.reason) for h in sessions]
    assert stats["gateway/errors"] == 0
    assert stats["gateway/reprefills"] >= 2  # the dead cells' sessions prefilled elsewhere
    assert ex.stats.cells_lost == 2 and ex.stats.cells_healed == 2
    # TITO: exactly the calls each harness made, once, in order
    tito = sorted(store.read("tito").to_pylist(), key=lambda r: r["t_start"])
    assert len({r["request_id"] for r in tito}) == len(tito)
    by_sid: dict[str, list[dict]] = {}
    for r in tito:
        by_sid.setdefault(r["session_id"], []).append(r)
    for h in sessions:
        recs = by_sid[h.session_id]
        assert len(recs) == h.calls > 0
        assert sorted(r["seq_no"] for r in recs) == list(range(h.calls))
    # sessions of each dead cell continued on another cell
    for dead in (dead_a, dead_b):
        moved = [
            sid
            for sid, recs in by_sid.items()
            if any(
                a["cell_id"] == dead and b["cell_id"] != dead for a, b in itertools.pairwise(recs)
            )
        ]
        assert moved, f"no session of {dead} continued elsewhere"
    rows = [r for r in store.read("cells").to_pylist() if r["event"] in ("lost", "rejoin")]
    assert [r["event"] for r in sorted(rows, key=lambda r: r["t"])] == [
        "lost",
        "rejoin",
        "lost",
        "rejoin",
    ]
    assert all(r["role"] == "rollout" for r in rows)
    print(f"\nrollout cells killed twice: {len(tito)} calls, wall {wall:.0f}s, {stats}")
