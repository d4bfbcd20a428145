"""Policy losses: hand values, and summed-weight (tree) == per-branch (flat) sums."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.train import losses


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def test_ppo_clip_by_hand():
    lp, blp = t(0.0, 0.0, 0.0, 0.0), torch.log(t(1.5, 0.5, 1.1, 0.9))
    lp.requires_grad_(True)
    # ratios r = exp(0 - blp) = 1/1.5, 2, 1/1.1, 1/0.9
    wp, wn = t(1.0, 1.0, 0.0, 0.0), t(0.0, 0.0, -2.0, -2.0)
    tok = losses.ppo_clip_token_loss(lp, blp, wp, wn, eps_low=0.2, eps_high=0.28)
    r = torch.exp(-blp)
    want = [-r[0], -1.28, 2.0 * max(r[2].item(), 0.8), 2.0 * max(r[3].item(), 0.8)]
    assert tok.tolist() == pytest.approx([float(x) for x in want])
    tok.sum().backward()
    # gradient d/dlogp: -A r where unclipped, 0 where clipped (token 1: r = 2 > 1.28)
    assert lp.grad.tolist() == pytest.approx(
        [-r[0].item(), 0.0, 2.0 * r[2].item(), 2.0 * r[3].item()]
    )


def test_asymmetric_clip_and_grpo_symmetric():
    lp, blp = t(0.0), torch.log(t(1 / 1.25))  # r = 1.25
    wp, wn = t(1.0), t(0.0)
    assert losses.ppo_clip_loss(
        lp, blp, wp, wn, normalizer=1.0, eps_high=0.28
    ).item() == pytest.approx(-1.25)
    assert losses.grpo_loss(lp, blp, wp, wn, normalizer=2.0, clip_eps=0.2).item() == pytest.approx(
        -1.2 / 2
    )


@pytest.mark.parametrize("seed", range(5))
def test_split_weights_equal_sum_over_branches(seed):
    """sum_b -min(r A_b, clip(r) A_b) == -W+ min(r, 1+eh) - W- max(r, 1-el), values and grads."""
    g = torch.Generator().manual_seed(seed)
    n_tok, n_branch = 50, 7
    base = torch.randn(n_tok, generator=g, dtype=torch.float64)
    blp = base + 0.6 * torch.randn(
        n_tok, generator=g, dtype=torch.float64
    )  # ratios well outside [0.8, 1.28] too
    adv = torch.randn(n_branch, generator=g, dtype=torch.float64)
    through = torch.rand(n_branch, n_tok, generator=g) < 0.5  # which branches pass each token
    lp1 = base.clone().requires_grad_(True)
    flat = torch.zeros((), dtype=torch.float64)
    for b in range(n_branch):
        r = torch.exp(lp1 - blp)
        clipped = torch.clamp(r, 0.8, 1.28)
        flat = flat + (-torch.minimum(r * adv[b], clipped * adv[b]) * through[b]).sum()
    flat.backward()
    lp2 = base.clone().requires_grad_(True)
    a = adv[:, None] * through
    wp, wn = a.clamp(min=0).sum(0), a.clamp(max=0).sum(0)
    tree = losses.ppo_clip_loss(lp2, blp, wp, wn, normalizer=1.0, eps_low=0.2, eps_high=0.28)
    tree.backward()
    assert abs(tree.item() - flat.item()) <= 1e-12
    assert torch.max(torch.abs(lp1.grad - lp2.grad)).item() <= 1e-12
    # one summed weight would not be the same
    lp3 = base.clone()
    summed = losses.ppo_clip_loss(lp3, blp, wp + wn, torch.zeros_like(wn), normalizer=1.0)
    assert abs(summed.item() - flat.item()) > 1e-6


def test_truncated_is():
    lp = t(0.0, 0.0).requires_grad_(True)
    blp = torch.log(t(0.25, 2.0))  # r = 4 (capped to 2), 0.5
    wp, wn = t(1.0, 0.0), t(0.0, -1.0)
    loss = losses.truncated_is_loss(lp, blp, wp, wn, normalizer=1.0, cap=2.0)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-2.0, 0.5])
    # is_mask routes stale tokens through TIS inside the clipped loss
    lp2 = t(0.0, 0.0).requires_grad_(True)
    mixed = losses.ppo_clip_loss(
        lp2, blp, wp, wn, normalizer=1.0, is_mask=torch.tensor([True, False])
    )
    mixed.backward()
    assert lp2.grad.tolist() == pytest.approx([-2.0, 0.0])  # token 2: A<0, r=0.5 < 0.8 clipped


def test_clip_fraction_and_overflow_guard():
    lp, blp = t(0.0, 0.0, 100.0), t(-1.0, 0.0, 0.0)
    wp, wn = t(1.0, 1.0, 0.0), t(0.0, 0.0, -1.0)
    assert losses.clip_fraction(lp, blp, wp, wn) == pytest.approx(1 / 3)
    lp = lp.float().requires_grad_(True)
    loss = losses.ppo_clip_loss(lp, blp.float(), wp.float(), wn.float(), normalizer=1.0)
    loss.backward()
    assert torch.isfinite(lp.grad).all()


def test_kl_k3_by_hand():
    lp = t(0.0, math.log(0.5), -1.0).requires_grad_(True)
    ref = t(math.log(2.0), math.log(0.5), -3.0)
    kl = losses.kl_k3(lp, ref)
    # d = ref - logp: e^d - d - 1 (>= 0, 0 iff the policies agree on the token)
    want = [2.0 - math.log(2.0) - 1.0, 0.0, math.exp(-2.0) + 2.0 - 1.0]
    assert kl.tolist() == pytest.approx(want)
    kl.sum().backward()
    # d/dlogp (e^d - d - 1) = 1 - e^d
    assert lp.grad.tolist() == pytest.approx([1 - 2.0, 0.0, 1 - math.exp(-2.0)])


def test_regularised_token_loss_counts_every_branch():
    pg, count = t(0.5, -1.0), t(3.0, 1.0)
    kl, ent = t(0.2, 0.0), t(1.0, 2.0)
    got = losses.regularised_token_loss(
        pg, count, kl=kl, kl_coef=0.1, entropy=ent, entropy_coef=0.01
    )
    assert got.tolist() == pytest.approx([0.5 + 0.1 * 3 * 0.2 - 0.01 * 3 * 1.0, -1.0 - 0.01 * 2.0])
    assert losses.regularised_token_loss(pg, count, kl=kl, entropy=ent).tolist() == pg.tolist()


def test_clip_counts_use_the_range_they_are_given():
    lp, blp = t(0.0, 0.0, 0.0), torch.log(t(1 / 1.25, 1 / 0.75, 1.0))  # r = 1.25, 0.75, 1
    wp, wn = t(1.0, 0.0, 0.0), t(0.0, -1.0, 0.0)  # the third token carries no weight
    assert losses.clip_counts(lp, blp, wp, wn, eps_low=0.2, eps_high=0.28) == (1, 2)
    assert losses.clip_counts(lp, blp, wp, wn, eps_low=0.2, eps_high=0.2) == (2, 2)
    assert losses.clip_counts(lp, blp, wp, wn, eps_low=0.3, eps_high=0.3) == (0, 2)
