"""The trainer's log-probs under the sampling processing: by hand, and against the engine.

The reference is written here from the definition: softmax of logits / T, cut to the k most
likely, then to the smallest most-likely-first prefix whose mass reaches top_p, renormalised.
The end-to-end check generates with the real embedded engine at temperature 0.7 / top_p 0.9
and scores the same tokens with the Trainer (same weights): ratios are 1 to ~1e-4.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from infra.engine.tiny_model import ARCHS
from tasks.train.logprobs import SamplingDist, SamplingDistError, token_logprobs


def drawn_from(z: list[float], dist: SamplingDist) -> list[float]:
    s = [x / dist.temperature for x in z]
    m = max(s)
    p = [math.exp(x - m) for x in s]
    p = [x / sum(p) for x in p]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    if 0 < dist.top_k < len(p):
        kept = set(order[: dist.top_k])
        p = [x if i in kept else 0.0 for i, x in enumerate(p)]
        p = [x / sum(p) for x in p]
    if dist.top_p < 1:
        mass, kept = 0.0, set()
        for i in order:
            if p[i] > 0 and mass < dist.top_p:
                kept.add(i)
                mass += p[i]
        p = [x if i in kept else 0.0 for i, x in enumerate(p)]
    return [x / sum(p) for x in p]


DISTS = [
    SamplingDist(),
    SamplingDist(temperature=0.7),
    SamplingDist(temperature=0.7, top_p=0.9),
    SamplingDist(temperature=1.3, top_k=5),
    SamplingDist(temperature=0.5, top_k=8, top_p=0.6),
]


@pytest.mark.parametrize("dist", DISTS, ids=str)
def test_token_logprobs_and_entropy_match_the_definition(dist):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 20, generator=g, dtype=torch.float64) * 2
    probs = [drawn_from(row, dist) for row in logits.tolist()]
    targets = torch.tensor([max(range(20), key=lambda i, q=q: q[i]) for q in probs])
    lp, ent = token_logprobs(logits, targets, dist, entropy=True)
    for t in range(6):
        q = probs[t]
        assert lp[t].item() == pytest.approx(math.log(q[int(targets[t])]), abs=1e-12)
        h = -sum(x * math.log(x) for x in q if x > 0)
        assert ent[t].item() == pytest.approx(h, abs=1e-12)


def test_gradient_flows_through_the_kept_set_only():
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0]], dtype=torch.float64, requires_grad=True)
    # T = 1, top_p = 0.7: p = [.66, .24, .03, .01] -> {0, 1} kept (0.66 before token 1 < 0.7)
    lp, _ = token_logprobs(logits, torch.tensor([1]), SamplingDist(top_p=0.7))
    lp.sum().backward()
    q1 = math.exp(2.0) / (math.exp(3.0) + math.exp(2.0))
    assert lp.item() == pytest.approx(math.log(q1))
    assert logits.grad.tolist()[0] == pytest.approx([-(1 - q1), 1 - q1, 0.0, 0.0])


def test_a_sampled_token_outside_the_trainers_nucleus_is_kept():
    """The engine sampled it, so it was in its nucleus: a rounding difference at the edge must
    not make it impossible (-inf would poison the loss)."""
    logits = torch.tensor([[5.0, 0.0, -1.0]], dtype=torch.float64)
    lp, ent = token_logprobs(logits, torch.tensor([2]), SamplingDist(top_p=0.5), entropy=True)
    assert math.isfinite(lp.item()) and math.isfinite(ent.item())
    assert lp.item() == pytest.approx(-1.0 - math.log(math.exp(5.0) + math.exp(-1.0)))


def test_bad_settings_are_named():
    with pytest.raises(SamplingDistError) as info:
        SamplingDist(temperature=0, top_p=1.5, top_k=-3)
    for part in ("temperature=0", "top_p=1.5", "top_k=-3"):
        assert part in str(info.value)


# ---- the embedded engine and the trainer agree ---------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(request, tmp_path_factory):
    """The tiny model (Qwen3 unless parametrized with another architecture family)."""
    from infra.engine.tiny_model import make_tiny_model

    arch = getattr(request, "param", "qwen3")
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / arch, seed=0, arch=arch)


@pytest.mark.parametrize("tiny_dir", ARCHS, indirect=True)
def test_engine_and_trainer_logprobs_agree_at_temperature_and_top_p(tiny_dir):
    """Generate at temperature 0.7, top_p 0.9 with the embedded engine; the trainer (same
    weights, same processing) scores the same tokens: every ratio is 1 to ~1e-4. Scored at
    temperature 1 (the old behaviour) the ratios are far from 1."""
    from infra.engine.engine import Engine
    from storage.tito import TitoRecord
    from tasks.train.packing import pack
    from tasks.train.trainer import Trainer, packed_logprobs
    from tasks.trajectory.sampler import build_samples
    from tasks.trajectory.tree import build_trees

    sp = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 24, "ignore_eos": True}
    eng = Engine(tiny_dir, max_batch_size=4)
    try:
        recs = []
        for i in range(3):
            prompt = [(7 * i + 3 * j) % 900 + 20 for j in range(12)]
            first = eng.generate(prompt, sp | {"sampling_seed": i})
            out1 = first["output_ids"]
            lp1 = [x[0] for x in first["meta_info"]["output_token_logprobs"]]
            turn2 = [*prompt, *out1, 5, 6, 7]
            second = eng.generate(turn2, sp | {"sampling_seed": 100 + i})
            sid = f"s{i}"
            recs += [
                TitoRecord("run", sid, f"{sid}-a", 0, None, 0, prompt, out1, lp1, 0),
                TitoRecord(
                    "run",
                    sid,
                    f"{sid}-b",
                    1,
                    f"{sid}-a",
                    len(prompt) + len(out1),
                    [5, 6, 7],
                    second["output_ids"],
                    [x[0] for x in second["meta_info"]["output_token_logprobs"]],
                    0,
                ),
            ]
    finally:
        eng.close()
    samples = build_samples(
        build_trees(recs), dict.fromkeys(["s0", "s1", "s2"], 1.0), advantage="reward"
    )
    gaps = {}
    for temperature, top_p in ((0.7, 0.9), (1.0, 1.0)):
        tr = Trainer(tiny_dir, temperature=temperature, top_p=top_p)
        worst = 0.0
        with torch.no_grad():
            for p in pack(samples, 4096):
                sel = np.flatnonzero(p.counts > 0)
                lp = packed_logprobs(tr.model, p, sel, dist=tr.dist).numpy()
                worst = max(worst, float(np.abs(lp - p.behaviour_logprobs[sel]).max()))
        gaps[temperature] = worst
        if temperature != 1.0:  # zero staleness: every ratio 1, nothing clipped
            m = tr.step(samples)
            assert m["train/clip_fraction"] == 0.0
            n = sum(s.n_flat_trainable for s in samples)
            assert m["train/loss"] == pytest.approx(-sum(s.weight_pos.sum() for s in samples) / n)
    assert gaps[0.7] <= 1e-4, gaps
    assert gaps[1.0] > 1e-2, gaps
