"""Policy losses over trainable tokens: pure tensor functions.

Every loss takes per-token tensors of shape (T,) over the tokens being trained:
``logp`` (current policy, differentiable), ``behaviour_logp`` (the policy that
generated the token), and two non-negative/non-positive weights:

    weight_pos = sum over branches b through the token with A_b > 0 of A_b   (>= 0)
    weight_neg = sum over branches b through the token with A_b < 0 of A_b   (<= 0)

A token shared by several branches is trained once. For the clipped surrogate a
single summed weight is not enough, because the clip depends on the sign of A:

    sum_b -min(r A_b, clip(r, 1-eps_low, 1+eps_high) A_b)
        = -weight_pos * min(r, 1+eps_high) - weight_neg * max(r, 1-eps_low)

so the tree loss equals the sum of per-branch flat losses token for token.

Normalisation is token-level with a given constant: ``loss = sum_tokens(l_t) /
normalizer``. Pass the number of trainable tokens the same branches would have
if trained flat (``Sample.n_flat_trainable`` summed over the step) and the tree
loss equals flat training with a token-mean over the step (as in DAPO /
Dr. GRPO, https://arxiv.org/abs/2503.14476, https://arxiv.org/abs/2503.20783).

Regularisers, per trained token and counted once per branch through it (``count``):

- KL to a reference policy with the k3 estimator (http://joschu.net/blog/kl-approx.html, as
  in GRPO, https://arxiv.org/abs/2402.03300 eq. 4): ``k3 = exp(ref - logp) - (ref - logp) - 1``,
  an unbiased, non-negative estimate of KL(pi || pi_ref) on tokens sampled from pi.
- entropy bonus: ``-H`` of the policy's (processed) next-token distribution.

``loss_t = pg_t + kl_coef * count_t * k3_t - entropy_coef * count_t * H_t``.
"""

from __future__ import annotations

import torch

# exp() of a log-ratio above this overflows float32 to inf, and 0 * inf in the
# backward pass is NaN; ratios this far out are clipped anyway for A > 0.
_MAX_LOG_RATIO = 30.0


def _ratio(logp: torch.Tensor, behaviour_logp: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.clamp(logp - behaviour_logp, max=_MAX_LOG_RATIO))


def ppo_clip_token_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    weight_pos: torch.Tensor,
    weight_neg: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    is_mask: torch.Tensor | None = None,
    is_cap: float = 2.0,
) -> torch.Tensor:
    """Per-token clipped surrogate (asymmetric clip, as in DAPO's clip-higher), shape (T,).

    ``is_mask`` (bool, (T,)) selects tokens too stale for the clipped ratio (policy
    version older than the staleness bound); they use ``truncated_is_token_loss``.
    """
    r = _ratio(logp, behaviour_logp)
    loss = -(
        weight_pos * torch.clamp(r, max=1.0 + eps_high)
        + weight_neg * torch.clamp(r, min=1.0 - eps_low)
    )
    if is_mask is not None:
        tis = truncated_is_token_loss(logp, behaviour_logp, weight_pos, weight_neg, cap=is_cap)
        loss = torch.where(is_mask, tis, loss)
    return loss


def truncated_is_token_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    weight_pos: torch.Tensor,
    weight_neg: torch.Tensor,
    *,
    cap: float = 2.0,
) -> torch.Tensor:
    """Policy gradient with a truncated importance weight, shape (T,).

    ``l_t = -min(r_t, cap).detach() * (weight_pos + weight_neg) * logp_t``: the
    gradient is the importance-corrected REINFORCE term with the ratio capped at
    ``cap`` (truncated IS, https://arxiv.org/abs/1606.02647 style truncation).
    """
    coef = torch.clamp(_ratio(logp, behaviour_logp), max=cap).detach()
    return -coef * (weight_pos + weight_neg) * logp


def ppo_clip_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    weight_pos: torch.Tensor,
    weight_neg: torch.Tensor,
    *,
    normalizer: float,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    is_mask: torch.Tensor | None = None,
    is_cap: float = 2.0,
) -> torch.Tensor:
    """Scalar PPO-clip loss: ``sum(ppo_clip_token_loss) / normalizer``."""
    tok = ppo_clip_token_loss(
        logp,
        behaviour_logp,
        weight_pos,
        weight_neg,
        eps_low=eps_low,
        eps_high=eps_high,
        is_mask=is_mask,
        is_cap=is_cap,
    )
    return tok.sum() / normalizer


def grpo_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    weight_pos: torch.Tensor,
    weight_neg: torch.Tensor,
    *,
    normalizer: float,
    clip_eps: float = 0.2,
    is_mask: torch.Tensor | None = None,
    is_cap: float = 2.0,
) -> torch.Tensor:
    """Scalar GRPO loss (https://arxiv.org/abs/2402.03300) with token-level normalisation.

    The advantages inside the weights are group-normalised rewards (the sampler's
    ``grpo`` estimator); the surrogate is the symmetric clip. The KL penalty to a
    reference model is left out (beta = 0, as in DAPO), and the per-sequence mean
    is replaced by the token-level constant ``normalizer`` so that tree and flat
    training agree exactly.
    """
    return ppo_clip_loss(
        logp,
        behaviour_logp,
        weight_pos,
        weight_neg,
        normalizer=normalizer,
        eps_low=clip_eps,
        eps_high=clip_eps,
        is_mask=is_mask,
        is_cap=is_cap,
    )


def truncated_is_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    weight_pos: torch.Tensor,
    weight_neg: torch.Tensor,
    *,
    normalizer: float,
    cap: float = 2.0,
) -> torch.Tensor:
    """Scalar truncated-IS policy-gradient loss: ``sum(truncated_is_token_loss) / normalizer``."""
    return (
        truncated_is_token_loss(logp, behaviour_logp, weight_pos, weight_neg, cap=cap).sum()
        / normalizer
    )


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref), shape (T,): ``e^d - d - 1``, ``d = ref - logp``.

    ``ref_logp`` carries no gradient (the reference is frozen). The log-ratio is clamped at
    ``+-_MAX_LOG_RATIO`` so that a token the reference finds impossible cannot overflow.
    """
    d = torch.clamp(ref_logp.detach() - logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(d) - d - 1.0


def regularised_token_loss(
    pg: torch.Tensor,
    count: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> torch.Tensor:
    """``pg + kl_coef * count * kl - entropy_coef * count * entropy``, shape (T,).

    ``count`` (T,) is how many branches train the token (its flat multiplicity).
    """
    out = pg
    if kl is not None and kl_coef:
        out = out + kl_coef * count * kl
    if entropy is not None and entropy_coef:
        out = out - entropy_coef * count * entropy
    return out


def clip_counts(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    weight_pos: torch.Tensor,
    weight_neg: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> tuple[int, int]:
    """(clipped, weighted): tokens whose ratio is clipped on a side that carries weight, and
    tokens that carry weight at all. A token with both signs counts as clipped when either
    side is."""
    with torch.no_grad():
        r = _ratio(logp, behaviour_logp)
        clipped = ((r > 1.0 + eps_high) & (weight_pos > 0)) | (
            (r < 1.0 - eps_low) & (weight_neg < 0)
        )
        active = (weight_pos > 0) | (weight_neg < 0)
        return int((clipped & active).sum()), int(active.sum())


def clip_fraction(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    weight_pos: torch.Tensor,
    weight_neg: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> float:
    """Fraction of weighted tokens whose ratio is clipped on a side that carries weight.

    Pass the clip range the loss uses: ``(eps, eps)`` for ``grpo``."""
    n_clip, n = clip_counts(
        logp, behaviour_logp, weight_pos, weight_neg, eps_low=eps_low, eps_high=eps_high
    )
    return n_clip / n if n else 0.0


LOSSES = ("ppo_clip", "grpo", "tis")
