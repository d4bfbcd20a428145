"""Tree-packed training == per-branch flat training (float64, and float32 within 1e-4), on each
architecture family (Qwen3, Llama as SmolLM2, Qwen2), and the Trainer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from storage.tito import TitoRecord
from tasks.train import tree_attention
from tasks.train.packing import pack
from tasks.train.trainer import (
    LossConfig,
    Trainer,
    flat_loss_and_grads,
    keep_norms_in_fp64,
    packed_logprobs,
    tree_loss_and_grads,
)
from tasks.trajectory.sampler import Sample, build_samples, group_advantages
from tasks.trajectory.synth import random_session, reference_paths
from tasks.trajectory.tree import POLICY, build_trees
from tests.models import ARCHS, micro_config

VOCAB = 40


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls: one thread is faster and steadier on a shared 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_model(dtype=torch.float64, seed=0, arch="qwen3"):
    torch.manual_seed(seed)
    cfg = micro_config(arch, VOCAB)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype)
    if dtype == torch.float64:
        # per layer: 2 norms (+ q/k norms in Qwen3); the final norm
        qk = 2 if arch == "qwen3" else 0
        assert keep_norms_in_fp64(model) == 2 * (2 + qk) + 1
    with torch.no_grad():  # larger weights than the init: logits far from uniform
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def flat_branches(records, spans, adv: float, session: str) -> list[Sample]:
    """The reference: every leaf call's path as its own chain, built from the records
    by plain recursion (no trie); exact duplicate paths once."""
    ref = reference_paths(records, spans)
    paths = {r.request_id: ref[r.request_id] for r in records}
    leaves: dict[tuple, str] = {}
    for r in records:
        tok, prov, ver, _ = paths[r.request_id]
        n = len(tok)
        extended = any(
            len(o[0]) > n
            and all(np.array_equal(o[i][:n], paths[r.request_id][i]) for i in range(3))
            for o in paths.values()
        )
        if not extended:
            leaves.setdefault((tok.tobytes(), prov.tobytes(), ver.tobytes()), r.request_id)
    out = []
    for rid in leaves.values():
        tok, prov, ver, lp = paths[rid]
        n = len(tok)
        train = (prov == POLICY) & (np.arange(n) > 0)
        w = np.where(train, adv, 0.0)
        out.append(
            Sample(
                run_id="run",
                sample_id=rid,
                session_id=session,
                group_id="g",
                step=0,
                token_ids=tok.astype(np.int32),
                parent_idx=(np.arange(n) - 1).astype(np.int32),
                positions=np.arange(n, dtype=np.int32),
                weight_pos=np.maximum(w, 0.0),
                weight_neg=np.minimum(w, 0.0),
                behaviour_logprobs=np.where(train, np.nan_to_num(lp.astype(np.float64)), 0.0),
                versions=ver,
                n_tokens=n,
                n_trainable=int(train.sum()),
                n_flat_tokens=n,
                reward=0.0,
                n_flat_trainable=int(train.sum()),
            )
        )
    return out


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(model, samples, branches, cfg, max_tokens, min_version=None, attention="tree"):
    norm = float(sum(s.n_flat_trainable for s in samples))
    assert norm == sum(b.n_flat_trainable for b in branches)
    model.zero_grad(set_to_none=True)
    tm = tree_loss_and_grads(
        model,
        samples,
        cfg=cfg,
        normalizer=norm,
        max_tokens=max_tokens,
        min_version=min_version,
        attention=attention,
    )
    tg = grads(model)
    model.zero_grad(set_to_none=True)
    model.set_attn_implementation("sdpa")  # the reference: the model's own causal SDPA
    fm = flat_loss_and_grads(model, branches, cfg=cfg, normalizer=norm, min_version=min_version)
    fg = grads(model)
    assert tg.keys() == fg.keys() and tg
    gdiff = max(float((tg[k] - fg[k]).abs().max()) for k in tg)
    gscale = max(float(fg[k].abs().max()) for k in fg)
    return abs(tm["loss"] - fm["loss"]), gdiff, gscale, tm, fm


def session(seed, sid, n_calls=10):
    rng = np.random.default_rng(seed)
    recs, spans = random_session(
        rng,
        n_calls=n_calls,
        session_id=sid,
        vocab=VOCAB,
        p_retry=0.25,
        p_reset=0.15,
        p_dup=0.15,
        p_tool=0.5,
    )
    return recs, spans


def one_group(seed):
    """Three random branching sessions (shared prefixes, retries, resets, duplicates, tool
    spans) in one group: (trees, tree samples, the flat reference branches, rewards, groups)."""
    sessions = {f"s{i}": session(100 * seed + i, f"s{i}") for i in range(3)}
    n_dup = n_reset = n_tool = 0
    for recs, sp in sessions.values():
        ref = reference_paths(recs, sp)
        n_dup += len(recs) - len(
            {ref[r.request_id][0].tobytes() + ref[r.request_id][2].tobytes() for r in recs}
        )
        n_reset += sum(r.parent_request_id is not None and r.prefix_len <= 6 for r in recs)
        n_tool += len(sp)
    assert n_dup and n_reset and n_tool, (n_dup, n_reset, n_tool)
    rewards = {"s0": 1.0, "s1": 0.25, "s2": 0.0}
    groups = dict.fromkeys(rewards, "g")
    all_recs = [r for recs, _ in sessions.values() for r in recs]
    spans = {k: v for _, sp in sessions.values() for k, v in sp.items()}
    trees = build_trees(all_recs, spans=spans)
    samples = build_samples(trees, rewards, groups)
    adv = group_advantages(rewards, groups)
    branches = [
        b for sid, (recs, sp) in sessions.items() for b in flat_branches(recs, sp, adv[sid], sid)
    ]
    return trees, samples, branches, rewards, groups


def max_tokens_partitioning(samples) -> int:
    """A small budget: the largest tree is partitioned, repeating only its ancestor path."""
    return max(s.n_tokens for s in samples) // 2 + max(int(s.positions.max()) for s in samples) + 1


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    ("loss", "seed", "attention"),
    [
        ("ppo_clip", 0, "tree"),
        ("grpo", 0, "tree"),
        ("ppo_clip", 1, "tree_block3"),
        ("ppo_clip", 1, "dense"),
        ("grpo", 2, "dense"),
    ],
)
def test_tree_equals_flat_fp64(loss, seed, attention, arch, monkeypatch):
    """Random branching sessions (shared prefixes, retries, resets, duplicates, tool
    spans) in one group: tree loss and every parameter gradient match flat."""
    if attention == "tree_block3":  # long chains cut into query blocks of 3
        monkeypatch.setattr(tree_attention, "BLOCK", 3)
        attention = "tree"
    model = tiny_model(seed=seed, arch=arch)
    trees, samples, branches, rewards, groups = one_group(seed)
    assert sum(s.n_flat_tokens for s in samples) == sum(b.n_tokens for b in branches)
    cfg = LossConfig(loss, 0.2, 0.28)
    max_tokens = max_tokens_partitioning(samples)
    dl, dg, scale, tm, _ = compare(model, samples, branches, cfg, max_tokens, attention=attention)
    assert tm["micro_batches"] >= 2
    assert 0.05 < tm["clip_fraction"] < 0.95, (
        "ratios should fall both inside and outside the clip range"
    )
    assert dl <= 1e-12 and dg <= 1e-12, (dl, dg)
    assert scale > 1e-3  # gradients are not trivially zero
    assert sum(s.n_tokens for s in samples) < sum(b.n_tokens for b in branches)
    # the sampler's own flat layout (the bench baseline) is the same training as the reference
    flat = build_samples(trees, rewards, groups, layout="flat")
    assert len(flat) == len(branches)
    norm = float(sum(s.n_flat_trainable for s in samples))
    with torch.no_grad():
        a = flat_loss_and_grads(model, flat, cfg=cfg, normalizer=norm, backward=False)
        b = flat_loss_and_grads(model, branches, cfg=cfg, normalizer=norm, backward=False)
    assert abs(a["loss"] - b["loss"]) <= 1e-12


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attention", ["tree", "dense"])
def test_tree_equals_flat_fp32(arch, attention):
    """As a user trains: float32 with transformers' own norms. Tree loss and gradients within
    1e-4 relative of flat (here ~1e-7: only the summation order differs)."""
    model = tiny_model(torch.float32, seed=0, arch=arch)
    _, samples, branches, _, _ = one_group(0)
    cfg = LossConfig("ppo_clip", 0.2, 0.28)
    max_tokens = max_tokens_partitioning(samples)
    dl, dg, scale, tm, fm = compare(model, samples, branches, cfg, max_tokens, attention=attention)
    assert tm["micro_batches"] >= 2 and scale > 1e-3
    assert dl <= 1e-4 * abs(fm["loss"]) and dg <= 1e-4 * scale, (dl, fm["loss"], dg, scale)


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_equals_flat_with_stale_tokens_truncated_is(arch):
    """Both signs of advantage reach the truncated-IS tokens (a rollout above and one below
    its group's mean)."""
    model = tiny_model(seed=3, arch=arch)
    (ra, sa), (rb, sb) = session(7, "s0", n_calls=12), session(8, "s1", n_calls=12)
    trees = build_trees(ra + rb, spans=sa | sb)
    rewards, groups = {"s0": 1.0, "s1": 0.0}, {"s0": "g", "s1": "g"}
    samples = build_samples(trees, rewards, groups)
    adv = group_advantages(rewards, groups)
    branches = flat_branches(ra, sa, adv["s0"], "s0") + flat_branches(rb, sb, adv["s1"], "s1")
    assert min(s.weight_neg.min() for s in samples) < 0 < max(s.weight_pos.max() for s in samples)
    vmax = max(r.weight_version for r in ra + rb)
    dl, dg, scale, _, _ = compare(
        model, samples, branches, LossConfig("ppo_clip", 0.2, 0.28), 4096, min_version=vmax
    )
    assert dl <= 1e-12 and dg <= 1e-12 and scale > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_ancestor_mask_reaches_attention(arch):
    """Packed logits of a branching tree equal each branch's own causal logits, and a
    forward without the mask (plain causal over the packed order) does not."""
    model = tiny_model(arch=arch)
    recs = [
        TitoRecord("run", "s", "a", 0, None, 0, [1, 2, 3], [4, 5], [-1.0, -1.0], 0),
        TitoRecord("run", "s", "b", 1, "a", 3, [6, 7], [8, 9], [-1.0, -1.0], 0),
    ]
    (smp,) = build_samples(build_trees(recs), {"s": 1.0}, advantage="reward")
    (p,) = pack([smp], 64)
    sel = np.flatnonzero(p.parent_idx >= 0)
    with torch.no_grad():
        tree_lp = packed_logprobs(model, p, sel)
        flat = {}
        for path in ([1, 2, 3, 4, 5], [1, 2, 3, 6, 7, 8, 9]):
            logits = model(input_ids=torch.tensor([path])).logits[0]
            lps = torch.log_softmax(logits, -1)
            for i in range(1, len(path)):
                flat[tuple(path[: i + 1])] = lps[i - 1, path[i]].item()
        want = []
        for i in sel:
            j, path = int(i), []
            while j >= 0:
                path.append(int(p.token_ids[j]))
                j = int(p.parent_idx[j])
            want.append(flat[tuple(path[::-1])])
        assert np.max(np.abs(tree_lp.numpy() - np.array(want))) < 1e-12
        causal = torch.log_softmax(
            model(input_ids=torch.as_tensor(p.token_ids)[None]).logits[0], -1
        )
        naive = causal[p.parent_idx[sel], p.token_ids[sel]].numpy()
        assert np.max(np.abs(naive - np.array(want))) > 1e-3


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory) -> Path:
    """A saved float32 micro model (Qwen3 unless parametrized with an architecture)."""
    arch = getattr(request, "param", "qwen3")
    d = tmp_path_factory.mktemp(f"tiny-{arch}")
    tiny_model(torch.float32, arch=arch).save_pretrained(d)
    (d / "tokenizer.json").write_text('{"version": "1.0"}')
    (d / "tokenizer_config.json").write_text("{}")
    return d


def train_samples(seed=0):
    sessions = [session(seed * 10 + i, f"s{i}") for i in range(2)]
    recs = [r for rs, _ in sessions for r in rs]
    spans = {k: v for _, sp in sessions for k, v in sp.items()}
    return build_samples(
        build_trees(recs, spans=spans), {"s0": 1.0, "s1": 0.0}, {"s0": "g", "s1": "g"}
    )


@pytest.mark.parametrize("model_dir", ARCHS, indirect=True)
def test_trainer_step_metrics_and_learning(model_dir):
    tr = Trainer(str(model_dir), lr=1e-2, max_tokens_per_micro=128)
    samples = train_samples()
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    m = tr.step(samples)
    for key in (
        "train/loss",
        "train/tokens",
        "train/trainable_tokens",
        "train/grad_norm",
        "train/clip_fraction",
    ):
        assert key in m and np.isfinite(m[key])
    assert m["train/tokens"] >= sum(s.n_tokens for s in samples)
    assert m["train/trainable_tokens"] == sum(s.n_trainable for s in samples)
    assert m["train/grad_norm"] > 0 and tr.version == 1
    assert any(not torch.equal(before[n], p) for n, p in tr.model.named_parameters())
    losses = [tr.step(samples)["train/loss"] for _ in range(5)]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("model_dir", ARCHS, indirect=True)
def test_trainer_save_load_resumes_exactly(model_dir, tmp_path):
    samples = train_samples(1)
    a = Trainer(str(model_dir), lr=1e-3, seed=1)
    a.step(samples)
    ckpt = a.save(str(tmp_path / "ckpt"))
    assert (Path(ckpt) / "model.safetensors").is_file() and (Path(ckpt) / "optimizer.pt").is_file()
    assert (Path(ckpt) / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert "gyre_tree" not in (Path(ckpt) / "config.json").read_text()  # loads anywhere
    b = Trainer.load(ckpt, lr=1e-3, seed=1)
    assert b.version == 1 and b.n_steps == 1
    assert b.optimizer.state_dict()["state"].keys() == a.optimizer.state_dict()["state"].keys()
    ma, mb = a.step(samples), b.step(samples)
    assert ma["train/loss"] == pytest.approx(mb["train/loss"], abs=1e-7)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-7), n


def test_trainer_rejects_bad_settings(model_dir):
    with pytest.raises(ValueError, match="loss='dpo'"):
        Trainer(str(model_dir), loss="dpo")
    with pytest.raises(ValueError, match="max_tokens_per_micro=0"):
        Trainer(str(model_dir), max_tokens_per_micro=0, lr=-1)


@pytest.mark.parametrize("loss", ["grpo", "tis"])
def test_trainer_other_losses_and_stale_tokens(model_dir, loss):
    samples = train_samples(2)
    vmax = max(int(s.versions.max()) for s in samples)
    tr = Trainer(str(model_dir), lr=1e-3, loss=loss, max_staleness=0, version=vmax + 2)
    m = tr.step(samples)
    assert np.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0
    assert m["train/staleness_mean"] >= 2
    empty = tr.step([])  # nothing to train: no update, no crash
    assert empty["train/tokens"] == 0 and empty["train/grad_norm"] == 0


def test_clip_fraction_uses_the_symmetric_range_for_grpo(model_dir):
    """Every weighted token at ratio 1.25: inside PPO's [0.8, 1.28], outside GRPO's [0.8, 1.2]."""
    sessions = [session(30 + i, f"s{i}") for i in range(2)]
    trees = build_trees(
        [r for rs, _ in sessions for r in rs],
        spans={k: v for _, sp in sessions for k, v in sp.items()},
    )
    samples = build_samples(trees, {"s0": 1.0, "s1": 0.5}, advantage="reward")  # A > 0
    tr = Trainer(str(model_dir), max_tokens_per_micro=4096)
    with torch.no_grad():
        for s in samples:
            (p,) = pack([s], 4096)
            sel = np.flatnonzero(p.counts > 0)
            s.behaviour_logprobs[sel] = packed_logprobs(tr.model, p, sel).double().numpy() - np.log(
                1.25
            )
    for loss, want in (("ppo_clip", 0.0), ("grpo", 1.0)):
        m = tree_loss_and_grads(
            tr.model,
            samples,
            cfg=LossConfig(loss, 0.2, 0.28),
            normalizer=1.0,
            backward=False,
        )
        assert m["clip_fraction"] == pytest.approx(want), loss


def zero_advantage_samples():
    sessions = [session(40 + i, f"s{i}") for i in range(2)]
    recs = [r for rs, _ in sessions for r in rs]
    spans = {k: v for _, sp in sessions for k, v in sp.items()}
    trees = build_trees(recs, spans=spans)
    samples = build_samples(trees, {"s0": 0.0, "s1": 0.0}, advantage="reward")
    assert all(not s.weight_pos.any() and not s.weight_neg.any() for s in samples)
    assert all(s.counts.sum() > 0 for s in samples)
    return samples


def test_kl_term_pulls_the_policy_toward_the_reference(model_dir, tmp_path):
    """No advantage at all: only the k3 KL to a different reference moves the policy, and
    the KL it reports falls step by step."""
    ref = tmp_path / "ref"
    tiny_model(torch.float32, seed=5).save_pretrained(ref)
    samples = zero_advantage_samples()
    tr = Trainer(str(model_dir), lr=1e-2, kl_coef=1.0, ref_model_dir=str(ref))
    kls = [tr.step(samples)["train/kl"] for _ in range(6)]
    assert kls[0] > 0.05 and kls[-1] < 0.7 * kls[0], kls
    still = Trainer(str(model_dir), lr=1e-2)  # no KL term: nothing to learn here
    m = still.step(samples)
    assert m["train/kl"] == 0.0 and m["train/grad_norm"] == 0.0
    with pytest.raises(ValueError, match="ref_model_dir"):
        Trainer.load(tr.save(str(tmp_path / "v6")), kl_coef=1.0)


def test_entropy_bonus_raises_the_entropy(model_dir):
    samples = zero_advantage_samples()
    tr = Trainer(str(model_dir), lr=1e-2, entropy_coef=1.0)
    ents = [tr.step(samples)["train/entropy"] for _ in range(6)]
    assert ents[-1] > ents[0] + 0.05, ents
