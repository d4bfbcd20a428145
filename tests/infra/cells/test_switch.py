"""Harness-preserving role switches on the real stack: a LocalCluster of cells, paced
engines on them, the gateway, and agent harnesses on the official openai client with
sessions in flight while the executor moves cells between rollout and training.

What must hold: no harness call fails (the gateway counted no error and every session
finished), live sessions really moved (rerouted, KV moved), and TITO is complete and
duplicate-free (each session's records are exactly the calls its harness made, seq_no
0..n-1, request ids unique). Every decision and role change is in the ``cells`` dataset
with its reason.
"""

from __future__ import annotations

import concurrent.futures as cf
import secrets
import time
from dataclasses import dataclass

import pytest

from infra.cells.cluster import start_cells
from infra.cells.executor import EngineSpec, Executor
from infra.engine.tiny_model import make_tiny_model
from infra.gateway.gateway import Gateway
from storage.checkpoints import publish_checkpoint
from storage.store import Store
from tasks.env.config import RolloutConfig
from tasks.handles import GroupSpec
from tasks.rollout import roll_out_group
from tasks.sched.coordinator import Move, MoveDone, RolloutFinished, StartRollouts
from tests.infra.cells.jobs import FutureJob

pytestmark = pytest.mark.integration

RCFG = RolloutConfig(group_size=2, subtasks=10, max_new_tokens=8, max_attempts=2, timeout_s=300)


@dataclass
class _Processed:
    samples_segment: str | None = None


class ThreadWork:
    """Real sessions (the rollout task's body, on threads here instead of Prefect tasks);
    processing is not under test here and returns an empty handle."""

    def __init__(self, gw: Gateway, store: Store, run_id: str, subtasks: int = RCFG.subtasks):
        self.gw, self.store, self.run_id = gw, store, run_id
        self.subtasks = subtasks  # each a turn: a session's length, at 0.15 s env steps
        self.pool = cf.ThreadPoolExecutor(8)

    def rollout(self, index: int, cell_id: str) -> FutureJob:
        spec = GroupSpec(
            index, f"g{index}", 100 + index, self.subtasks, env_step_s=0.15, cell_id=cell_id
        )
        return FutureJob(
            self.pool.submit(
                roll_out_group,
                self.gw.url,
                self.gw.admin_token,
                self.store,
                self.run_id,
                spec,
                RCFG,
            )
        )

    def process(self, index, sessions, version, workers=()) -> FutureJob:
        f: cf.Future = cf.Future()
        f.set_result(_Processed())
        return FutureJob(f)

    def step(self, plan):  # pragma: no cover - no step in this test
        raise AssertionError("no training step here")


def _wait(ex: Executor, seen: list, want, timeout: float = 240) -> None:
    """Collect events into ``seen`` until one of them satisfies ``want``."""
    deadline = time.monotonic() + timeout
    while not any(want(e) for e in seen):
        assert time.monotonic() < deadline, f"timed out after {timeout}s; saw {seen}"
        seen += ex.events(timeout=0.5)


def test_switches_with_live_sessions_lose_no_call(tmp_path):
    store = Store(str(tmp_path / "store"))
    run_id = "switch"
    model_dir = make_tiny_model()
    publish_checkpoint(store, run_id, model_dir, 0)
    publish_checkpoint(store, run_id, model_dir, 1)  # the "newest weights" a joiner loads
    with start_cells(3, threads_per_cell=2, rollout_slots=4, harness_slots=4) as cells:
        gw = Gateway(
            store,
            run_id=run_id,
            tokenizer_dir=model_dir,
            admin_token=secrets.token_urlsafe(8),
            spool_dir=str(tmp_path / "spool"),
        )
        gw.start()
        # sessions of 30 turns (~10 s), so both of g1's are still live when the withdrawal
        # comes even on a slowed machine (10 turns: one had ended under mutmut's trampoline)
        work = ThreadWork(gw, store, run_id, subtasks=30)
        engine = EngineSpec(model_dir=model_dir, decode_step_s=0.03, prefill_tokens_per_s=20000)
        ex = Executor(cells, gw, store, run_id, work, engine, version=0, drain_timeout_s=30)
        try:
            ex.start(("rollout", "rollout", "rollout"), "test: initial roles")
            seen: list = []
            ex.apply(Move(2, "train"), "test: park cell 2's engine")  # no session yet
            _wait(ex, seen, lambda e: isinstance(e, MoveDone) and e.cell == 2)
            for d in (StartRollouts(0, 2), StartRollouts(1, 2)):
                ex.apply(d, "test")
            deadline = time.monotonic() + 120
            while gw.stats()["gateway/calls"] < 4:  # sessions are under way, more calls to come
                assert time.monotonic() < deadline, "no session made a call within 120s"
                time.sleep(0.1)
            # rollout -> train with its live sessions rerouted to cell 0, at call boundaries
            ex.apply(Move(1, "train", reroute=((0, 2),)), "test: water above the high mark")
            _wait(ex, seen, lambda e: isinstance(e, MoveDone) and e.cell == 1)
            moved = ex.stats.sessions_rerouted
            # train -> rollout: loads the newest weights before the gateway routes to it
            ex.version = 1
            ex.apply(Move(2, "rollout"), "test: water below the low mark")
            _wait(
                ex, seen, lambda e: sum(isinstance(x, MoveDone) and x.cell == 2 for x in seen) == 2
            )
            live = ex.in_flight()
            assert ex.engine_version[2] == 1
            # and cell 0, now holding every session, hands them to cell 2
            ex.apply(Move(0, "train", reroute=((2, 4),)), "test: second switch")
            _wait(ex, seen, lambda e: isinstance(e, MoveDone) and e.cell == 0)
            _wait(ex, seen, lambda e: sum(isinstance(x, RolloutFinished) for x in seen) == 4)
            stats = gw.stats()
        finally:
            ex.close()
            gw.stop()
    sessions = [h for g in ex.groups.values() for h in g.sessions]
    assert len(sessions) == 8
    assert all(h.status == "finished" for h in sessions), [(h.status, h.reason) for h in sessions]
    assert stats["gateway/errors"] == 0
    assert moved > 0 and ex.stats.sessions_rerouted > moved  # both switches moved live sessions
    assert ex.stats.kv_moved > 0
    # TITO: exactly the calls each harness made, once, in order
    tito = store.read("tito").to_pylist()
    by_sid: dict[str, list[dict]] = {}
    for r in tito:
        by_sid.setdefault(r["session_id"], []).append(r)
    assert len({r["request_id"] for r in tito}) == len(tito)
    for h in sessions:
        recs = by_sid[h.session_id]
        assert len(recs) == h.calls > 0
        assert sorted(r["seq_no"] for r in recs) == list(range(h.calls))
    cells_used = {r["cell_id"] for r in tito}
    assert len(cells_used) == 3  # calls ran on every cell that served
    rows = sorted(store.read("cells").to_pylist(), key=lambda r: r["t"])
    # no call started on a cell while it held the train role
    training: dict[str, float] = {}
    for r in rows:
        if r["event"] == "role" and r["role"] == "train":
            training[r["cell_id"]] = r["t"]
        elif r["event"] == "decide" and r["cell_id"] in training:
            t0 = training.pop(r["cell_id"])
            bad = [x for x in tito if x["cell_id"] == r["cell_id"] and t0 < x["t_start"] < r["t"]]
            assert not bad, f"{len(bad)} calls on {r['cell_id']} while it trained"
    for cid, t0 in training.items():
        bad = [x for x in tito if x["cell_id"] == cid and x["t_start"] > t0]
        assert not bad, f"{len(bad)} calls on {cid} while it trained"
    assert live, "the sessions ended before the last switch: make them longer"
    decided = [r for r in rows if r["event"] == "decide"]
    assert len(decided) == 4 and all(r["reason"].startswith("test:") for r in decided)
    assert [(r["cell_id"], r["role"]) for r in rows if r["event"] == "role"] == [
        (ex.cell_id(2), "train"),
        (ex.cell_id(1), "train"),
        (ex.cell_id(2), "rollout"),
        (ex.cell_id(0), "train"),
    ]


def test_a_withdrawn_cells_groups_go_where_the_move_reroutes_them(tmp_path):
    """The coordinator books a withdrawn cell's groups on the cells its ``Move`` names; the
    sessions' next calls must run there, not on the least-loaded cell (here an empty one)."""
    store = Store(str(tmp_path / "store"))
    run_id = "reroute"
    model_dir = make_tiny_model()
    publish_checkpoint(store, run_id, model_dir, 0)
    with start_cells(3, threads_per_cell=2, rollout_slots=4, harness_slots=4) as cells:
        gw = Gateway(
            store,
            run_id=run_id,
            tokenizer_dir=model_dir,
            admin_token=secrets.token_urlsafe(8),
            spool_dir=str(tmp_path / "spool"),
        )
        gw.start()
        # sessions of 30 turns (~10 s), so both of g1's are still live when the withdrawal
        # comes even on a slowed machine (10 turns: one had ended under mutmut's trampoline)
        work = ThreadWork(gw, store, run_id, subtasks=30)
        engine = EngineSpec(model_dir=model_dir, decode_step_s=0.03, prefill_tokens_per_s=20000)
        ex = Executor(cells, gw, store, run_id, work, engine, version=0, drain_timeout_s=30)
        try:
            ex.start(("rollout", "rollout", "rollout"), "test: initial roles")
            seen: list = []
            for d in (StartRollouts(0, 1), StartRollouts(1, 1)):  # cell 2 stays empty
                ex.apply(d, "test")
            deadline = time.monotonic() + 120
            # both of g1's sessions sit on cell 1 once each has made a call (a session's
            # first call places it; thirty turns keep it live for ~10 s)
            while not (
                len(g1 := gw.group_sessions("g1")) == RCFG.group_size
                and all(s["calls"] >= 1 for s in g1)
            ):
                assert time.monotonic() < deadline, "g1's sessions made no call within 120s"
                time.sleep(0.05)
            t_move = time.time()
            ex.apply(Move(1, "train", reroute=((0, 1),)), "test: cell 1's group to cell 0")
            _wait(ex, seen, lambda e: isinstance(e, MoveDone) and e.cell == 1)
            _wait(ex, seen, lambda e: sum(isinstance(x, RolloutFinished) for x in seen) == 2)
        finally:
            ex.close()
            gw.stop()
    moved = {h.session_id for h in ex.groups[1].sessions}
    after = [
        r["cell_id"]
        for r in store.read("tito").to_pylist()
        if r["session_id"] in moved and r["t_start"] > t_move
    ]
    assert ex.stats.sessions_rerouted == 2 and after, "g1's two sessions did not both move"
    assert set(after) == {ex.cell_id(0)}, after  # never the empty cell 2
    assert ex.groups[1].cell == 0
