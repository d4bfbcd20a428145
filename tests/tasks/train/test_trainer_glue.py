"""The code around the loss: what ``Trainer.step`` does with the gradient, and the
distribution the trainer scores tokens under, each checked against a plain reference.

- Clipping: the parameter change of one step equals a textbook clip-then-AdamW step
  computed here from the unclipped gradient, and the clipped gradient's norm is at most
  ``max_grad_norm``.
- Sampling distribution: a run's rollout sampling settings (temperature, top-p) reach the
  trainer through the run config and the training task, so that tokens the engine sampled
  under them score the engine's own reported log-probs (ratio 1 at zero staleness).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from tasks.train.trainer import Trainer
from tasks.trajectory.sampler import build_samples
from tasks.trajectory.synth import random_session
from tasks.trajectory.tree import build_trees
from tests.models import micro_qwen3_config

VOCAB = 40


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(micro_qwen3_config(VOCAB), attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    d = tmp_path_factory.mktemp("micro") / "model"
    model.save_pretrained(d)
    return str(d)


def _batch(seed: int = 0, n: int = 4):
    rng = np.random.default_rng(seed)
    recs, spans = [], {}
    for i in range(n):
        r, sp = random_session(rng, n_calls=6, session_id=f"s{i}", p_version_bump=0.0)
        recs += r
        spans.update(sp)
    rewards = {f"s{i}": float(i % 2) for i in range(n)}
    return build_samples(build_trees(recs, spans=spans), rewards, dict.fromkeys(rewards, "g"))


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("max_norm", [1e-9, 0.05])
def test_clipping_bounds_the_update_like_a_textbook_clip(micro_dir, max_norm):
    """One step == unclipped gradient, clipped by hand, then AdamW's first step by hand."""
    samples = _batch()
    lr, eps, beta2 = 1e-3, 1e-8, 0.999
    trainer = Trainer(micro_dir, lr=lr, max_grad_norm=max_norm, max_tokens_per_micro=64)
    # the unclipped gradient, from a copy of the same weights and the same loss
    ref = copy.deepcopy(trainer.model)
    ref.zero_grad(set_to_none=True)
    probe = Trainer.__new__(Trainer)
    probe.__dict__.update(trainer.__dict__, model=ref)
    probe.loss_and_grads(samples)
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    assert norm > 10 * max_norm  # the clip must bite
    scale = min(1.0, max_norm / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_
    before = _params(trainer.model)

    seen: list[float] = []
    step = trainer.optimizer.step

    def spy(*a, **kw):  # the gradient the optimizer is handed
        gs = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        seen.append(math.sqrt(sum(float((g.double() ** 2).sum()) for g in gs)))
        return step(*a, **kw)

    trainer.optimizer.step = spy
    m = trainer.step(samples)
    assert m["train/grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert seen and seen[0] <= max_norm * (1 + 1e-5)
    assert seen[0] == pytest.approx(norm * scale, rel=1e-4)
    after = _params(trainer.model)
    for n, p0 in before.items():
        g = grads.get(n)
        if g is None:
            assert torch.equal(after[n], p0), n
            continue
        g = g * scale
        # AdamW step 1, bias-corrected: m_hat = g, v_hat = g^2; weight decay 0
        want = p0 - lr * g / (torch.sqrt(g * g * (1 - beta2) / (1 - beta2)) + eps)
        # within float32 rounding of the weights themselves
        tol = 2 * torch.finfo(torch.float32).eps * p0.abs() + 1e-4 * lr
        err = (after[n] - want).abs() - tol
        assert float(err.max()) <= 0, f"{n}: |dw - textbook| exceeds rounding by {err.max():.3e}"


def test_no_clip_when_max_grad_norm_is_none(micro_dir):
    samples = _batch(1)
    a = Trainer(micro_dir, lr=1e-3, max_grad_norm=None, max_tokens_per_micro=64)
    b = Trainer(micro_dir, lr=1e-3, max_grad_norm=1e9, max_tokens_per_micro=64)
    ma, mb = a.step(samples), b.step(samples)
    assert ma["train/grad_norm"] == pytest.approx(mb["train/grad_norm"], rel=1e-6)
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q), n


# ---- the trainer's sampling distribution is the rollouts' ---------------------------------


@pytest.mark.parametrize(
    "rollout", [{"temperature": 0.6, "top_p": 0.8}, {"temperature": 1.7, "top_p": 1.0}]
)
def test_trainer_scores_under_the_rollout_distribution(tmp_path, rollout):
    """Tokens the engine sampled with the run's rollout settings: the trainer, built the
    way a run builds it (run config -> train section -> restore from the store), gives
    them the engine's own log-probs, so the clipped ratio is 1 and nothing is clipped."""
    from flows.config import RunConfig
    from infra.engine.engine import Engine
    from infra.engine.tiny_model import make_tiny_model
    from storage.checkpoints import publish_checkpoint
    from storage.store import Store
    from storage.tito import TitoRecord
    from tasks.train.packing import pack
    from tasks.train.trainer import packed_logprobs
    from tasks.train_step import restore_trainer

    cfg = RunConfig.model_validate({"rollout": {"suite": "arith", **rollout}})
    assert cfg.rollout.temperature == rollout["temperature"]
    model_dir = make_tiny_model()
    store = Store(str(tmp_path / "store"))
    publish_checkpoint(store, "r", model_dir, 0)
    trainer = restore_trainer(store, "r", 0, cfg.train)

    engine = Engine(model_dir, cell_id="e")
    try:
        params = {
            "max_new_tokens": 24,
            "ignore_eos": True,
            "temperature": cfg.rollout.temperature,
            "top_p": cfg.rollout.top_p,
            "sampling_seed": 3,
        }
        recs = []
        for i in range(3):
            prompt = [int(x) for x in np.random.default_rng(i).integers(10, 200, 20)]
            res = engine.generate(prompt, params)
            lps = [lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]]
            recs.append(
                TitoRecord("r", f"s{i}", f"s{i}-0", 0, None, 0, prompt, res["output_ids"], lps, 0)
            )
    finally:
        engine.close()
    samples = build_samples(
        build_trees(recs), {r.session_id: 1.0 for r in recs}, advantage="reward"
    )
    packed = pack(samples, 4096)[0]
    sel = np.flatnonzero(packed.counts > 0)
    assert sel.size == 3 * 24  # every output token
    with torch.no_grad():
        got = packed_logprobs(trainer.model, packed, sel, dist=trainer.dist).numpy()
    want = packed.behaviour_logprobs[sel]
    assert np.abs(got - want).max() <= 1e-4
    # and through the loss: ratio 1 everywhere, pg = -sum(weights) / N, nothing clipped
    m = trainer.loss_and_grads(samples)
    n = sum(s.n_flat_trainable for s in samples)
    assert m["clip_fraction"] == 0.0
    assert m["pg_loss"] == pytest.approx(-float(packed.weight_pos[sel].sum()) / n, rel=1e-4)


def test_a_saved_and_loaded_trainer_continues_like_the_uninterrupted_one(micro_dir, tmp_path):
    """Resume: weights, AdamW moments and counters come back, so the next step is the same."""
    a = Trainer(micro_dir, lr=1e-3, max_tokens_per_micro=64)
    a.step(_batch(2))
    b = Trainer.load(a.save(str(tmp_path / "ck")), lr=1e-3, max_tokens_per_micro=64)
    assert (b.version, b.n_steps) == (a.version, a.n_steps) == (1, 1)
    ma, mb = a.step(_batch(3)), b.step(_batch(3))
    assert mb["train/loss"] == pytest.approx(ma["train/loss"], rel=1e-6)
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert float((p - q).detach().abs().max()) <= 1e-7, n
