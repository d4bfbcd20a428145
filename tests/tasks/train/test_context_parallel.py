"""Context parallel over k members (gloo, spawned processes) == one process, exactly.

The reference is textbook: the whole packed sequence in one forward through the model's
own SDPA with a dense ancestor mask (token i sees j iff j is i or an ancestor of i).
"""

from __future__ import annotations

import itertools
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tasks.train import context_parallel as cp
from tasks.train import dp
from tests.models import micro_config

VOCAB = 64


def _tree(seed: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A random topologically ordered tree: ids, depths, parent_idx, loss tokens, weights."""
    rng = np.random.default_rng(seed)
    parent = np.full(n, -1, np.int64)
    for i in range(1, n):
        parent[i] = i - 1 if rng.random() < 0.8 else rng.integers(0, i)
    depth = np.zeros(n, np.int64)
    for i in range(1, n):
        depth[i] = depth[parent[i]] + 1
    sel = np.flatnonzero((parent >= 0) & (rng.random(n) < 0.7))
    return rng.integers(0, VOCAB, n), depth, parent, sel, rng.normal(size=len(sel))


def _model(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = micro_config("qwen3", VOCAB)
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg).to(dtype)


def _reference(dtype, ids, depth, parent, sel, w):
    model = _model(dtype)
    n = len(ids)
    anc = np.eye(n, dtype=bool)
    for i in range(n):
        if parent[i] >= 0:
            anc[i] |= anc[parent[i]]
    out = model.model(
        input_ids=torch.as_tensor(ids)[None],
        position_ids=torch.as_tensor(depth)[None],
        attention_mask=torch.as_tensor(anc)[None, None],
    )
    logits = model.lm_head(out.last_hidden_state[0, parent[sel]])
    logp = torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(ids[sel])[:, None])[:, 0]
    loss = -(torch.as_tensor(w, dtype=dtype) * logp).sum() / len(sel)
    loss.backward()
    return float(loss.detach()), {k: p.grad.numpy().copy() for k, p in model.named_parameters()}


def _member(rank: int, world: int, store_path: str, dtypes, tree, out) -> None:
    """One member: its share of the loss and the summed gradients, for each dtype."""
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        ids, depth, parent, sel, w = tree
        results = []
        for dtype in dtypes:
            model = _model(dtype)
            logp, _, mine = cp.member_logprobs(model, ids, depth, parent, sel)
            loss = -(torch.as_tensor(w[mine], dtype=dtype) * logp).sum() / len(sel)
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            grads = {}
            for k, p in model.named_parameters():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(g)
                grads[k] = g.numpy().copy()
            results.append((float(total), grads))
        if rank == 0:
            out.put(results)
        dist.destroy_process_group()
    except BaseException:
        out.put(("error", traceback.format_exc()))


def _run_cp(tmp_path, world, dtypes, tree):
    """Spawn ``world`` gloo members (a FileStore under tmp_path); rank 0's results."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = str(tmp_path / f"store-{world}")
    procs = [
        ctx.Process(target=_member, args=(r, world, store, dtypes, tree, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    res = out.get(timeout=180)
    for p in procs:
        p.join(timeout=60)
    assert res[0] != "error", res[1]
    return res


def _check(dtype, got, want) -> None:
    (loss, grads), (ref_loss, ref_grads) = got, want
    if dtype == torch.float64:
        assert abs(loss - ref_loss) <= 1e-10
        for k, g in ref_grads.items():
            assert np.abs(grads[k] - g).max() <= 1e-10, k
    else:
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
        for k, g in ref_grads.items():
            rel = np.abs(grads[k] - g).max() / max(np.abs(g).max(), 1e-30)
            assert rel <= 1e-5, (k, rel)


def test_split_is_contiguous_balanced_and_complete():
    _, _, parent, _, _ = _tree(0, 200)
    cuts = cp.split(parent, 3)
    assert cuts[0][0] == 0 and cuts[-1][1] == 200
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(cuts))


def test_two_members_equal_one_fp64_and_fp32(tmp_path):
    """Loss and every parameter gradient: 2 members == 1 (fp64 <= 1e-10, fp32 rel <= 1e-5)."""
    tree = _tree(2, 90)
    dtypes = [torch.float64, torch.float32]
    for dtype, got in zip(dtypes, _run_cp(tmp_path, 2, dtypes, tree), strict=True):
        _check(dtype, got, _reference(dtype, *tree))


@pytest.mark.slow
def test_three_members_equal_one(tmp_path):
    tree = _tree(3, 90)
    (got,) = _run_cp(tmp_path, 3, [torch.float64], tree)
    _check(torch.float64, got, _reference(torch.float64, *tree))


def test_long_items_go_context_parallel_the_rest_shard():
    sizes = [10, 5000, 30, 20, 9000, 40]
    long, parts = dp.shard_with_context_parallel(sizes, 2, budget=4096)
    assert long == [1, 4]
    assert sorted(i for p in parts for i in p) == [0, 2, 3, 5]
    assert [sum(sizes[i] for i in p) for p in parts] == [50, 50]


def _trainer_member(rank: int, world: int, store_path: str, seed: int, dirs, out) -> None:
    """One member of the real Trainer path: its slice of every sample, summed over members."""
    try:
        from tests.tasks.train.test_exactness import make_case, project_loss

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        m, grads, _ = project_loss(make_case(seed), *dirs, context_parallel=True)
        loss = torch.tensor([m["loss"], m["trainable_tokens"]], dtype=torch.float64)
        dist.all_reduce(loss)
        summed = {}
        for k, g in sorted(grads.items()):
            dist.all_reduce(g)
            summed[k] = g.numpy().copy()
        if rank == 0:
            out.put((loss.tolist(), summed))
        dist.destroy_process_group()
    except BaseException:
        out.put(("error", traceback.format_exc()))


@pytest.fixture(scope="module")
def exactness_dirs(tmp_path_factory):
    from tests.tasks.train.test_exactness import _save_model

    d = tmp_path_factory.mktemp("cp-trainer")
    return _save_model(d / "policy", 0, "qwen3"), _save_model(d / "reference", 1, "qwen3")


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_trainer_context_parallel_equals_textbook_reference(world, tmp_path, exactness_dirs):
    """Trainer.loss_and_grads with every sample context parallel over ``world`` gloo members
    (seed 8: PPO clip, truncated IS for stale tokens, KL to a reference, entropy bonus,
    top-k sampling) == test_exactness's textbook flat reference, fp64: the loss, the
    trainable-token count and every gradient, summed over members."""
    from tests.tasks.train.test_exactness import load, make_case, reference_loss

    seed = 8
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [
        ctx.Process(target=_trainer_member, args=(r, world, store, seed, exactness_dirs, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    res = out.get(timeout=240)
    for p in procs:
        p.join(timeout=60)
    assert res[0] != "error", res[1]
    (loss, n_trainable), grads = res
    c = make_case(seed)
    model, ref_model = load(exactness_dirs[0]), load(exactness_dirs[1])
    want, _ = reference_loss(c, model, ref_model)
    want.backward()
    assert abs(loss - float(want.detach())) <= 1e-12
    assert n_trainable > 0
    ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(grads) == sorted(ref)
    for k, g in ref.items():
        assert float(np.abs(grads[k] - g.numpy()).max()) <= 1e-12 * max(
            1.0, float(g.abs().max())
        ), k
