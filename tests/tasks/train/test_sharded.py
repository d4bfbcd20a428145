"""Sharded training (FSDP2 over gloo, spawned processes) == one replica; a 2 -> 3 -> 1
regroup resumes from the sharded DCP state exactly (tasks/train/sharded.py).

Members are real processes meeting through the DP generations' TCPStore (tasks/train/dp.py),
on the micro Qwen3 model and the synthetic batches of the DP test (tests/tasks/test_dp.py).
The reference is one plain ``Trainer`` in this process. Clipping is on (``MAX_NORM`` below
the batches' gradient norms), so the clipped gradients that reach AdamW (captured by an
optimizer step pre-hook) say whether the norm was the global one over shards.

Tolerances (fp32): loss, gradient norm, clipped gradients and weights within a relative
1e-5 of the replica (per tensor: max |a - b| / max |b|): the members' sum differs from one
replica's only in fp32 summation order. ``LR = 1e-4``: AdamW maps that rounding on
coordinates whose gradient is near eps to at most ~lr (see test_dp.py's note).
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.train import dp, sharded
from tests.tasks.test_dp import _batch, _model_dir

pytestmark = pytest.mark.integration

LR = 1e-4
MAX_NORM = 0.05
REL = 1e-5
PRELOAD = [
    "tasks.train.sharded",
    "tests.tasks.test_dp",
    "transformers.models.qwen3.modeling_qwen3",
    "tasks.trajectory.synth",
    "tasks.trajectory.tree",
]


def _trainer(model_dir: str):
    from tasks.train.trainer import Trainer

    return Trainer(model_dir, lr=LR, max_tokens_per_micro=96, seed=0, max_grad_norm=MAX_NORM)


def _np(t: torch.Tensor) -> np.ndarray:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().numpy().copy()


def _grads(model) -> dict[str, np.ndarray]:
    """Full gradients by name (a collective for a sharded model: every member calls it)."""
    return {n: _np(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _full_state(trainer) -> dict[str, np.ndarray]:
    """Weights and AdamW state, full, by name (``model/...``, ``optim/...``); rank 0 only
    for a sharded trainer (empty elsewhere). Collective when sharded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(trainer.model, trainer.optimizer, options=opts)
    out = {f"model/{k}": _np(v) for k, v in msd.items()}
    for name, st in osd.get("state", {}).items():
        for k, v in st.items():
            out[f"optim/{name}/{k}"] = _np(v) if torch.is_tensor(v) else np.asarray(v)
    return out


def _step(trainer, seed: int, **kw) -> tuple[float, float, dict[str, np.ndarray]]:
    """One step on batch ``seed`` (seeds >= 100: the first sample of batch ``seed - 100``
    alone, so some member trains nothing):
    (loss, grad norm, the clipped gradients AdamW received)."""
    samples = _batch(seed - 100)[:1] if seed >= 100 else _batch(seed)
    clipped: dict[str, np.ndarray] = {}
    hook = trainer.optimizer.register_step_pre_hook(
        lambda *_: clipped.update(_grads(trainer.model))
    )
    try:
        if kw:
            m = sharded.sharded_step(trainer, samples, **kw)
        else:
            m = trainer.step(samples)
    finally:
        hook.remove()
    return m["train/loss"], m["train/grad_norm"], clipped


def _member(name: str, model_dir: str, inbox, outbox) -> None:
    """A worker process: forms each generation it is told, runs the ops, reports."""
    torch.set_num_threads(1)
    group = trainer = None
    try:
        while (msg := inbox.get()) is not None:
            rv, ops = msg
            if group is None or group.rv != rv:
                if group is not None:
                    group.close()
                group = dp.DPGroup(rv, backend="gloo", timeout_s=120)
                trainer = None  # an FSDP model is bound to its group's mesh
            out: dict = {}
            for op, arg in ops:
                if op == "build":
                    trainer = sharded.shard_trainer(_trainer(model_dir))
                elif op == "load":
                    sharded.load_sharded(trainer, arg)
                elif op == "step":
                    loss, norm, clipped = _step(trainer, arg, rank=rv.rank, world=rv.world)
                    m = group.reduce_metrics({"train/loss": loss})
                    out.setdefault("steps", []).append((m["train/loss"], norm, clipped))
                elif op == "full":
                    out.setdefault("full", []).append(_full_state(trainer))
                elif op == "save":
                    sharded.save_sharded(trainer, arg)
                elif op == "consolidate":
                    out["ckpt"] = sharded.save_consolidated(trainer, arg)
                elif op == "bytes":
                    out.setdefault("bytes", []).append(sharded.state_bytes(trainer))
            out["version"] = trainer.version
            outbox.put((name, out))
    except Exception:
        outbox.put((name, {"error": traceback.format_exc()}))
    finally:
        if group is not None:
            group.close()


class _Members:
    """Named worker processes and the run's rendezvous store."""

    def __init__(self, names: str, model_dir: str):
        self.store, self.port = dp.host_store("127.0.0.1", timeout_s=120)
        # forked from one server that imported torch and transformers once (a fresh
        # interpreter per member costs ~5 s of imports on this machine's 2 cores)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self.outbox = ctx.Queue()
        self.inboxes = {n: ctx.Queue() for n in names}
        self.procs = {
            n: ctx.Process(target=_member, args=(n, model_dir, q, self.outbox), daemon=True)
            for n, q in self.inboxes.items()
        }
        for p in self.procs.values():
            p.start()
        self.generation = -1

    def run(self, members: str, ops) -> dict[str, dict]:
        """A new generation of ``members`` (rank order), each running ``ops``."""
        self.generation += 1
        for rank, n in enumerate(members):
            rv = dp.Rendezvous("127.0.0.1", self.port, self.generation, rank, len(members))
            self.inboxes[n].put((rv, ops))
        got = {}
        for _ in members:
            name, out = self.outbox.get(timeout=300)
            assert "error" not in out, f"member {name}: {out['error']}"
            got[name] = out
        return got

    def close(self) -> None:
        for q in self.inboxes.values():
            q.put(None)
        for p in self.procs.values():
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        del self.store


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-30))


def _check_step(got, want, what: str) -> None:
    (loss, norm, clipped), (ref_loss, ref_norm, ref_clipped) = got, want
    assert ref_norm > MAX_NORM, "clipping must be active for the check to mean anything"
    assert abs(loss - ref_loss) <= REL * abs(ref_loss), (what, loss, ref_loss)
    assert abs(norm - ref_norm) <= REL * ref_norm, (what, norm, ref_norm)
    assert clipped.keys() == ref_clipped.keys()
    for k, g in ref_clipped.items():
        assert _rel(clipped[k], g) <= REL, (what, k, _rel(clipped[k], g))


def _check_weights(full: dict[str, np.ndarray], ref, what: str) -> None:
    want = {n: _np(p) for n, p in ref.model.named_parameters()}
    for k, w in want.items():
        assert _rel(full[f"model/{k}"], w) <= REL, (what, k, _rel(full[f"model/{k}"], w))


def _k_members_equal_one(tmp_path: Path, k: int) -> None:
    """k members train three steps (the last on one sample: some member trains nothing but
    still takes part) and write the consolidated checkpoint of v3; one replica
    trains the same steps."""
    from transformers import AutoModelForCausalLM

    from storage.checkpoints import read_digest, weights_digest

    model_dir = _model_dir(tmp_path)
    names = "ABC"[:k]
    members = _Members(names, model_dir)
    ckpt = str(tmp_path / "v3")
    try:
        ops = [("step", 0), ("full", None), ("step", 1), ("full", None)]
        ops += [("step", 100), ("full", None)]  # one sample: member B's part is empty
        got = members.run(names, [("build", None), *ops, ("consolidate", ckpt)])
    finally:
        members.close()
    ref = _trainer(model_dir)
    for i, seed in enumerate([0, 1, 100]):
        want = _step(ref, seed)
        for n in names:
            _check_step(got[n]["steps"][i], want, f"step {i} member {n}")
        _check_weights(got["A"]["full"][i], ref, f"weights after step {i}")
    assert {got[n]["version"] for n in names} == {3}
    # the served weights' digest: the consolidated checkpoint's recorded digest, the
    # digest of what an engine loads from it, and that of the sharded state's full weights
    assert got["A"]["ckpt"] == ckpt and all(got[n]["ckpt"] is None for n in names[1:])
    recorded = read_digest(ckpt)["sha256"]
    loaded = weights_digest(AutoModelForCausalLM.from_pretrained(ckpt))
    full = {
        k.removeprefix("model/"): torch.from_numpy(v)
        for k, v in got["A"]["full"][2].items()
        if k.startswith("model/")
    }
    gathered = weights_digest(sharded.consolidated_model(ref, full))
    assert recorded == loaded == gathered


def test_two_members_equal_one_replica_and_the_consolidated_digest(tmp_path):
    _k_members_equal_one(tmp_path, 2)


@pytest.mark.slow
def test_three_members_equal_one_replica(tmp_path):
    _k_members_equal_one(tmp_path, 3)


def test_regroup_two_three_one_resumes_from_the_sharded_state_exactly(tmp_path):
    """{A, B} step, save -> {A, B, C} load, step, save -> {B} load, step. Each load gives
    bit for bit the weights and AdamW state that were saved (DCP resharding 2 -> 3 and
    3 -> 1), and every step equals the replica's. Every member of a new group, survivors
    too, starts from a fresh trainer: nothing but the sharded state carries over."""
    model_dir = _model_dir(tmp_path)
    members = _Members("ABC", model_dir)
    s0, s1 = str(tmp_path / "s1"), "file://" + str(tmp_path / "s2")  # a path; an fsspec URL
    try:
        g0 = members.run("AB", [("build", None), ("step", 0), ("full", None), ("save", s0)])
        g1 = members.run(
            "ABC",
            [
                ("build", None),
                ("load", s0),
                ("full", None),
                ("step", 1),
                ("full", None),
                ("save", s1),
            ],
        )
        g2 = members.run("B", [("build", None), ("load", s1), ("full", None), ("step", 2)])
    finally:
        members.close()
    saved0, loaded0, saved1 = g0["A"]["full"][0], g1["A"]["full"][0], g1["A"]["full"][1]
    loaded1 = g2["B"]["full"][0]
    for saved, loaded in ((saved0, loaded0), (saved1, loaded1)):
        assert saved.keys() == loaded.keys()
        assert any(k.startswith("optim/") and k.endswith("exp_avg_sq") for k in saved)
        for k, v in saved.items():
            assert np.array_equal(v, loaded[k]), k
    assert [g0["A"]["version"], g1["C"]["version"], g2["B"]["version"]] == [1, 2, 3]
    ref = _trainer(model_dir)
    for i, (g, names) in enumerate(((g0, "AB"), (g1, "ABC"), (g2, "B"))):
        want = _step(ref, i)
        for n in names:
            _check_step(g[n]["steps"][0], want, f"step {i} member {n}")
        if i < 2:
            _check_weights((saved0, saved1)[i], ref, f"weights after step {i}")
