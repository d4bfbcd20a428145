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
import multiprocessing as mp
import queue
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


def test_a_gradient_on_one_member_is_summed_with_zeros_on_the_other(caplog):
    """(and the step's metrics: summed, the clip fraction weighted by trainable tokens)"""
    store, port = dp.host_store("127.0.0.1", timeout_s=60)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    other = ctx.Process(target=_member, args=(port, 1, out), daemon=True)
    other.start()
    here: queue.Queue = queue.Queue()
    try:
        with caplog.at_level(logging.INFO, logger=dp.__name__):
            _member(port, 0, here)  # rank 0, in this process
        got = dict([here.get_nowait(), out.get(timeout=120)])
    finally:
        if torch.distributed.is_initialized():  # rank 0 failed past the formation
            torch.distributed.destroy_process_group()
        other.join(timeout=30)
        if other.is_alive():
            other.kill()
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
