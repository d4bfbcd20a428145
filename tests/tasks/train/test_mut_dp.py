"""``DPGroup.reduce_grads`` sums a parameter that has a gradient on only ONE member
(tasks/train/dp.py), with two real gloo processes.

A member's micro-batches may leave a parameter without a gradient (an embedding row or a
head no token of its shard reaches) while the other member's do not: the sum must then be
the textbook one, the other member's gradient plus zero, on both members. A parameter with
a gradient on no member keeps ``None`` on both. A mutant that reduced only parameters with
a gradient on more than one member survived the fast suite (bench/mutation.py, issue 26):
in the other DP tests every parameter has a gradient on both members.

The same members reduce their step metrics (summed; the clip fraction weighted by each
member's trainable tokens: two mutants of it survived).

Rank 0 runs in the test process itself (rank 1 in a spawned one): mutmut learns which tests
reach a function in the test process only, so with both members in children ``DPGroup``'s
methods were "no tests" to it, left to the bench's slower rerun (which ran out of time on
some). Its formation is logged at INFO under pytest's capture, which fails a test whose
record cannot be formatted (two mutants broke the line's format or its arguments).

The optimizer-state helpers a join's ``broadcast_state`` uses (``_has_opt_state``,
``_init_opt_state``, ``_opt_tensors``) are pinned in process: a joiner's fresh AdamW gets
the sender's layout, and with the sender's values its next update is the sender's.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import queue
import re
import time
import traceback
from types import SimpleNamespace

import pytest
import torch

from tasks.train import dp

pytestmark = pytest.mark.integration

NAMES = ("both", "only0", "only1", "none")
BIG = 2**24 + 1  # the first integer float32 cannot hold


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.ModuleDict({n: torch.nn.Linear(3, 2) for n in NAMES})


def _grad(rank: int, name: str, shape: torch.Size, k: int) -> torch.Tensor:
    """Member ``rank``'s gradient of the ``k``-th parameter of ``name`` (distinct values)."""
    base = 10.0**rank * (k + 1) * (NAMES.index(name) + 1)
    return torch.arange(shape.numel(), dtype=torch.float32).reshape(shape) + base


def _has(rank: int, name: str) -> bool:
    return name == "both" or name == f"only{rank}"


def _metrics(rank: int) -> dict[str, float]:
    """Member ``rank``'s step metrics: summed ones, a clip fraction, one that is not summed."""
    return {
        "train/loss": 1.5 * (rank + 1),
        "train/tokens": float(BIG) if rank == 0 else 2.0,  # float32 would round the sum
        "train/trainable_tokens": 10.0 * (rank + 1),
        "train/clip_fraction": 0.1 * (rank + 1),
        "train/lr": 0.01,
    }


def _member(port: int, rank: int, out) -> None:
    """Set this member's gradients (``only{other}`` and ``none`` left None), reduce them,
    send back each parameter's gradient (None where it has none)."""
    try:
        model = _model()
        for name, mod in model.items():
            for k, p in enumerate(mod.parameters()):
                p.grad = _grad(rank, name, p.shape, k) if _has(rank, name) else None
        group = dp.DPGroup(
            dp.Rendezvous("127.0.0.1", port, 0, rank, 2), backend="gloo", timeout_s=30
        )
        try:
            group.reduce_grads(model)
            metrics = group.reduce_metrics(_metrics(rank))
            metrics["gathered"] = group.all_gather_ints(5 + rank)
        finally:
            group.close()
        grads = {
            f"{name}.{k}": None if p.grad is None else p.grad.tolist()
            for name, mod in model.items()
            for k, p in enumerate(mod.parameters())
        }
        out.put((rank, (grads, metrics)))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def _run_members(target, world: int, port: int, *rank0_args, **rank0_kw) -> dict:
    """Run ``target(port, rank, out, ...)`` as every member of a ``world``-member group: rank 0
    in this process (given ``rank0_args`` / ``rank0_kw``), the others spawned. Returns each
    rank's result; a group rank 0 left formed is destroyed and no spawned member outlives the
    call."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    others = [ctx.Process(target=target, args=(port, r, out), daemon=True) for r in range(1, world)]
    for p in others:
        p.start()
    here: queue.Queue = queue.Queue()
    try:
        target(port, 0, here, *rank0_args, **rank0_kw)
        return dict([here.get_nowait()] + [out.get(timeout=120) for _ in others])
    finally:
        if torch.distributed.is_initialized():  # rank 0 failed past the formation
            torch.distributed.destroy_process_group()
        for p in others:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def test_a_gradient_on_one_member_is_summed_with_zeros_on_the_other(caplog):
    """(and the step's metrics: summed, the clip fraction weighted by trainable tokens)"""
    store, port = dp.host_store("127.0.0.1", timeout_s=60)
    with caplog.at_level(logging.INFO, logger=dp.__name__):
        got = _run_members(_member, 2, port)
    for rank, res in got.items():
        assert isinstance(res, tuple), f"member {rank} failed:\n{res}"
    formed = [r for r in caplog.records if r.name == dp.__name__ and r.levelno == logging.INFO]
    assert len(formed) == 1 and formed[0].getMessage()  # the formation, reported once
    # the clip fraction is weighted by each member's trainable tokens: (0.1*10 + 0.2*20) / 30
    want_metrics = {
        "train/loss": 4.5,
        "train/tokens": float(BIG + 2),
        "train/trainable_tokens": 30.0,
        "train/clip_fraction": 5.0 / 30.0,
        "train/lr": 0.01,
    }
    for rank in (0, 1):
        m = got[rank][1]
        assert m.pop("gathered") == [5, 6], (rank, m)
        assert m == pytest.approx(want_metrics), (rank, m)
        assert m["train/tokens"] == BIG + 2  # exact: summed in float64
    got = {rank: res[0] for rank, res in got.items()}
    model = _model()
    for name, mod in model.items():
        for k, p in enumerate(mod.parameters()):
            key = f"{name}.{k}"
            parts = [_grad(r, name, p.shape, k) for r in (0, 1) if _has(r, name)]
            for rank in (0, 1):
                g = got[rank][key]
                if not parts:
                    assert g is None, f"{key} has a gradient on no member: stays None on {rank}"
                    continue
                assert g is not None, f"{key}: no gradient after the reduce on member {rank}"
                want = sum(parts, torch.zeros(p.shape))
                assert torch.equal(torch.tensor(g), want), (key, rank, g, want.tolist())
    del store


# -- the optimizer-state helpers a join's broadcast uses (in process: no group needed) ----


def _trainer(seed: int) -> SimpleNamespace:
    """What the helpers read of a Trainer: its model and its AdamW."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    return SimpleNamespace(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1))


def _step(trainer: SimpleNamespace, seed: int) -> None:
    torch.manual_seed(seed)
    trainer.optimizer.zero_grad()
    trainer.model(torch.randn(5, 3)).square().sum().backward()
    trainer.optimizer.step()


def test_a_fresh_optimizer_has_no_state_and_a_stepped_one_has():
    t = _trainer(0)
    assert dp._has_opt_state(t) == 0
    _step(t, 1)
    assert dp._has_opt_state(t) == 1


def test_a_receivers_state_is_laid_out_as_the_senders_and_steps_as_it_does():
    """A joiner's fresh optimizer gets AdamW's state tensors (zeros) in the sender's layout,
    so the broadcast's tensor lists pair up; with the sender's values copied in, the
    joiner's next update is the sender's, bit for bit."""
    sender, receiver = _trainer(0), _trainer(0)
    _step(sender, 1)
    _step(sender, 2)
    dp._init_opt_state(receiver)
    got, want = dp._opt_tensors(receiver), dp._opt_tensors(sender)
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]
    assert len(want) == 3 * len(list(sender.model.parameters()))  # step, exp_avg, exp_avg_sq
    assert all(not t.any() for t in got)
    with torch.no_grad():
        for a, b in zip(sender.model.parameters(), receiver.model.parameters(), strict=True):
            b.copy_(a)
        for src, dst in zip(want, got, strict=True):
            dst.copy_(src)
    _step(sender, 3)
    _step(receiver, 3)
    for a, b in zip(sender.model.parameters(), receiver.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert receiver.optimizer.state[next(iter(receiver.model.parameters()))]["step"] == 3


def test_init_opt_state_keeps_a_state_already_there():
    t = _trainer(0)
    _step(t, 1)
    before = [x.clone() for x in dp._opt_tensors(t)]
    dp._init_opt_state(t)
    assert all(torch.equal(a, b) for a, b in zip(before, dp._opt_tensors(t), strict=True))


def test_auto_backend_and_a_plans_rendezvous():
    want = "nccl" if torch.cuda.is_available() else "gloo"
    assert dp.pick_backend("auto") == want and dp.pick_backend("gloo") == "gloo"
    plan = dp.StepPlan(
        step=3, version=2, generation=7, host="10.0.0.1", port=4321, members=("a", "b", "c"),
        groups=(0,), segments=(), shuffle_seed=0, workers=(),
    )  # fmt: skip
    assert plan.rendezvous(1) == dp.Rendezvous("10.0.0.1", 4321, 7, 1, 3)


# -- sync_state and broadcast_state over three real members (rank 0 in this process) -----
#
# The whole-set mutation run (bench/mutation.py --sample 0, issue 26) found them reached only
# by slow tests: every mutant of the join's state transfer survived the fast suite.


def _replica(seed: int, version: int, steps: int) -> SimpleNamespace:
    """A trainer replica: a model, its AdamW stepped ``steps`` times, its counters."""
    t = _trainer(seed)
    for k in range(steps):
        _step(t, 100 + seed * 10 + k)
    t.version, t.n_steps = version, steps
    return t


def _state(t: SimpleNamespace | None) -> dict | None:
    if t is None:
        return None
    return {
        "params": [p.detach().clone().tolist() for p in t.model.parameters()],
        "opt": [x.clone().tolist() for x in dp._opt_tensors(t)],
        "version": t.version,
        "n_steps": t.n_steps,
    }


# each round: (version, {rank: (seed, version, steps) of its replica or None})
ROUNDS = (
    (3, {0: None, 1: (1, 3, 2), 2: (2, 3, 1)}),  # rank 0 has none: loads, then receives rank 1's
    (5, {0: (0, 4, 1), 1: (1, 5, 2), 2: (2, 5, 3)}),  # rank 0's is older: no load, receives
    (6, {0: (0, 6, 0), 1: None, 2: (2, 2, 0)}),  # the holder has no optimizer state yet
    (7, {0: (0, 7, 1), 1: (1, 7, 1), 2: (2, 7, 1)}),  # every member holds it: kept
    (8, {0: (0, 7, 1), 1: None, 2: (2, 1, 1)}),  # none holds it: each loads the checkpoint
)
LOADED = (9, 0)  # what load() restores: (seed, steps); its version is the round's


def _sync_member(port: int, rank: int, out, local_host: str | None = None, **kw) -> None:
    """``kw``: DPGroup's backend (gloo unless given; rank 0 takes its default)."""
    try:
        group = dp.DPGroup(
            dp.Rendezvous("127.0.0.1", port, 0, rank, 3),
            local_host=local_host,
            **(kw or {"backend": "gloo", "timeout_s": 60}),
        )
        res: dict = {"formed_s": group.formed_s, "ifname": os.environ.get(dp.GLOO_IFNAME)}
        try:
            for version, plan in ROUNDS:
                spec = plan[rank]
                mine = None if spec is None else _replica(*spec)
                loads = []

                def load(version=version, loads=loads):
                    loads.append(version)
                    return _replica(LOADED[0], version, LOADED[1])

                got, how = dp.sync_state(group, mine, version, load)
                res[version] = (how, loads, got is mine, _state(got))
            res["no_clip"] = group.reduce_metrics(
                {"train/loss": 1.0, "train/trainable_tokens": 5.0}
            )
            res["no_tokens"] = group.reduce_metrics({"train/loss": 1.0, "train/clip_fraction": 0.5})
        finally:
            group.close()
        out.put((rank, res))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def _routable_address() -> tuple[str, str] | None:
    """A non-loopback IPv4 address of an interface that is up, and the interface (None if
    this machine has none)."""
    import socket

    import psutil

    up = {n for n, st in psutil.net_if_stats().items() if st.isup}
    for name, addrs in psutil.net_if_addrs().items():
        if name not in up:
            continue
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address, name
    return None


def test_sync_state_brings_every_member_to_the_version(caplog, monkeypatch):
    """Three members, five rounds: the lowest-ranked holder's model, optimizer moments and
    counters reach every other member exactly (a member with no replica loads one to receive
    into, one with an older replica does not load); all holders keep theirs; none holding it,
    each loads the checkpoint. Rank 0 takes the default backend (gloo: no CUDA) and gives its
    routable address, so gloo is told its interface."""
    monkeypatch.delenv(dp.GLOO_IFNAME, raising=False)
    monkeypatch.delenv("_GYRE_GLOO_FOR", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # rank 0's default: gloo
    routable = _routable_address()
    store, port = dp.host_store("127.0.0.1", timeout_s=60)
    with caplog.at_level(logging.INFO, logger=dp.__name__):
        got = _run_members(_sync_member, 3, port, routable[0] if routable else None, timeout_s=60)
    for rank, res in got.items():
        assert isinstance(res, dict), f"member {rank} failed:\n{res}"
    # the formation: timed from this member's start, logged once with the backend
    assert 0 <= got[0]["formed_s"] < 60
    (formed,) = [r for r in caplog.records if r.name == dp.__name__ and r.levelno == logging.INFO]
    assert re.fullmatch(
        r"DP generation 0: rank 0 of 3 formed in \d+\.\d\ds \(gloo\)", formed.getMessage()
    ), formed.getMessage()
    if routable:
        assert got[0]["ifname"] == routable[1]

    def want(spec):
        return _state(None if spec is None else _replica(*spec))

    # round 1 (v3): rank 1 is the lowest holder; rank 0 loaded once, to receive into
    sent = want(ROUNDS[0][1][1])
    for rank in (0, 1, 2):
        how, loads, same, state = got[rank][3]
        assert (how, state) == ("broadcast", sent), rank
        assert loads == ([3] if rank == 0 else []), rank
    # round 2 (v5): rank 0's older replica is overwritten, nothing loaded
    sent = want(ROUNDS[1][1][1])
    for rank in (0, 1, 2):
        how, loads, same, state = got[rank][5]
        assert (how, loads, same, state) == ("broadcast", [], True, sent), rank
    # round 3 (v6): the holder (rank 0) has no optimizer state: only weights and counters
    sent = want(ROUNDS[2][1][0])
    assert sent["opt"] == []
    for rank in (0, 1, 2):
        how, loads, same, state = got[rank][6]
        assert (how, state) == ("broadcast", sent), rank
        assert loads == ([6] if rank == 1 else []), rank
    # round 4 (v7): every member holds it: each keeps its own replica, untouched
    for rank in (0, 1, 2):
        how, loads, same, state = got[rank][7]
        assert (how, loads, same, state) == ("kept", [], True, want(ROUNDS[3][1][rank])), rank
    # round 5 (v8): no member holds it: each restores the checkpoint
    loaded = _state(_replica(LOADED[0], 8, LOADED[1]))
    for rank in (0, 1, 2):
        how, loads, same, state = got[rank][8]
        assert (how, loads, state) == ("checkpoint", [8], loaded), rank
    # metrics without a clip fraction, or without trainable tokens: the fraction is 0
    for rank in (0, 1, 2):
        assert got[rank]["no_clip"] == {
            "train/loss": 3.0, "train/trainable_tokens": 15.0, "train/clip_fraction": 0.0,
        }  # fmt: skip
        assert got[rank]["no_tokens"] == {"train/loss": 3.0, "train/clip_fraction": 0.0}
    del store


# -- the pure helpers around a group -----------------------------------------------------


def test_a_rank_outside_the_world_is_refused_before_meeting():
    for rank, world in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(dp.DPError, match=rf"^rank {rank} outside a world of {world}$"):
            dp.DPGroup(dp.Rendezvous("127.0.0.1", 1, 0, rank, world), backend="gloo")


def test_a_member_left_alone_fails_with_the_rendezvous_in_its_message():
    store, port = dp.host_store("127.0.0.1", timeout_s=30)
    try:
        with pytest.raises(dp.DPError) as err:
            dp.DPGroup(dp.Rendezvous("127.0.0.1", port, 4, 0, 2), backend="gloo", timeout_s=1)
        assert re.match(
            rf"^generation 4: rank 0 of 2 could not form the group at 127\.0\.0\.1:{port} "
            r"within 1s: .", str(err.value),
        ), str(err.value)  # fmt: skip
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        del store


def test_host_stores_on_their_defaults_are_independent_servers():
    """The defaults: loopback, a free port each (two at once do not collide)."""
    (a, pa), (b, pb) = dp.host_store(), dp.host_store()
    assert pa > 0 and pb > 0 and pa != pb
    client = torch.distributed.TCPStore("127.0.0.1", pa, is_master=False)
    client.set("k", "v")
    assert a.get("k") == b"v"
    del a, b, client


def test_auto_backend_picks_nccl_where_cuda_is(monkeypatch):
    assert dp.pick_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert dp.pick_backend() == "nccl" and dp.pick_backend("auto") == "nccl"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dp.pick_backend() == "gloo" and dp.pick_backend("nccl") == "nccl"


def test_pace_sleeps_what_is_left_and_only_that():
    t0 = time.monotonic()
    slept = dp.pace(t0, 0.9)  # under a second left: still slept
    assert 0 < slept <= 0.9 and time.monotonic() - t0 >= 0.9
    assert dp.pace(time.monotonic() - 10, 1.0) == 0.0  # already past: no sleep
    t1 = time.monotonic()
    assert dp.pace(t1, math.inf) == 0.0 and time.monotonic() - t1 < 5  # unpaced


def test_interface_of_names_the_interface_holding_an_address():
    import psutil

    loop = [n for n, a in psutil.net_if_addrs().items() if any(x.address == "127.0.0.1" for x in a)]
    assert dp.interface_of("127.0.0.1") == loop[0]
    assert dp.interface_of("203.0.113.9") is None  # TEST-NET-3: on no interface
    routable = _routable_address()
    if routable:
        assert dp.interface_of(routable[0]) == routable[1]


def test_use_interface_of(monkeypatch):
    """Loopback or no address changes nothing; a routable one names its interface (and is
    remembered as ours); the user's own setting wins; ours is re-derived for a new address."""
    monkeypatch.delenv(dp.GLOO_IFNAME, raising=False)
    monkeypatch.delenv("_GYRE_GLOO_FOR", raising=False)
    for addr in (None, "127.0.0.1", "localhost", "::1"):
        assert dp.use_interface_of(addr) is None
        assert dp.GLOO_IFNAME not in os.environ and "_GYRE_GLOO_FOR" not in os.environ, addr
    monkeypatch.setenv(dp.GLOO_IFNAME, "user0")
    assert dp.use_interface_of("127.0.0.1") == "user0"
    assert dp.use_interface_of("203.0.113.9") == "user0"  # the user's: kept
    assert os.environ[dp.GLOO_IFNAME] == "user0" and "_GYRE_GLOO_FOR" not in os.environ
    monkeypatch.delenv(dp.GLOO_IFNAME)
    assert dp.use_interface_of("203.0.113.9") is None  # on no interface: nothing set
    assert dp.GLOO_IFNAME not in os.environ
    routable = _routable_address()
    if routable is None:
        pytest.skip("no routable IPv4 address on this machine")
    addr, name = routable
    assert dp.use_interface_of(addr) == name
    assert os.environ[dp.GLOO_IFNAME] == name and os.environ["_GYRE_GLOO_FOR"] == addr
    for loop in ("127.0.0.1", "localhost", "::1"):  # loopback: what is in force, unchanged
        assert dp.use_interface_of(loop) == name and os.environ[dp.GLOO_IFNAME] == name, loop
    # ours, set for an address whose interface has since changed: derived again
    monkeypatch.setenv(dp.GLOO_IFNAME, "stale0")
    assert dp.use_interface_of(addr) == name and os.environ[dp.GLOO_IFNAME] == name
