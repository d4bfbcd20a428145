"""Log-probabilities under the distribution the engine actually sampled from.

The embedded engine (infra/engine/sampling.py) draws every token from the model's logits
after temperature, top-k and top-p, and reports the token's log-probability under that
*processed* distribution. For the importance ratio ``pi_new / pi_behaviour`` to be exactly 1
at zero staleness, the trainer must score the same tokens under the same processing of its
own logits. ``SamplingDist`` names the processing; ``token_logprobs`` applies it.

Processing, in the engine's order, for logits ``z`` (T, V):

1. ``s = z / temperature`` (``temperature > 0``). A greedy engine call (temperature 0)
   reports the raw ``log_softmax(z)``: score it with temperature 1.
2. top-k (``0 < k < V``): tokens scoring below the k-th largest score are removed (ties
   with the k-th stay).
3. top-p (``< 1``): with ``p = softmax(s)`` over what is left, sorted descending, a token
   stays iff the mass of the tokens strictly before it is ``< top_p`` (so the most likely
   token always stays).
4. ``log q = log_softmax(s)`` over the kept tokens (renormalised).

The kept set is a discrete choice and carries no gradient; gradients flow through the kept
tokens' logits (the renormaliser). The target token is always kept: the engine sampled it,
so it was in the engine's kept set, and a rounding difference at the nucleus edge must not
turn a sampled token into ``-inf``.

A real SGLang server reports ``log_softmax(z / temperature)`` before top-k / top-p (and the
raw ``log_softmax(z)`` with ``SGLANG_RETURN_ORIGINAL_LOGPROB``): against it, train with
``top_p = 1`` and ``top_k = -1`` and the rollout's temperature.

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class SamplingDistError(ValueError):
    """Invalid temperature / top-p / top-k for the trainer's log-probabilities."""


@dataclass(frozen=True)
class SamplingDist:
    """The processing the rollouts were sampled with (see the module docstring)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k

    def __post_init__(self) -> None:
        errors = []
        if not self.temperature > 0:
            errors.append(
                f"temperature={self.temperature}: must be > 0 (greedy rollouts report raw "
                "logprobs: use 1.0)"
            )
        if not 0 < self.top_p <= 1:
            errors.append(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < -1:
            errors.append(f"top_k={self.top_k}: must be -1 (off) or >= 0")
        if errors:
            raise SamplingDistError("; ".join(errors))

    @property
    def raw(self) -> bool:
        """True when the processing is the identity (temperature 1, no top-k, no top-p)."""
        return self.temperature == 1.0 and self.top_p >= 1.0 and self.top_k <= 0


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    dist: SamplingDist = SamplingDist(),
    *,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log q(targets), H(q) or None)``, each (T,), for logits (T, V) and targets (T,).

    ``q`` is the processed distribution of ``dist``; the entropy is that of ``q`` (over the
    kept tokens). Half-precision logits are upcast to float32; float64 stays float64.
    """
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if dist.temperature != 1.0:
        x = x / dist.temperature
    n, v = x.shape
    keep: torch.Tensor | None = None
    with torch.no_grad():
        if 0 < dist.top_k < v:
            kth = torch.topk(x, dist.top_k, dim=-1).values[:, -1:]  # (T, 1)
            keep = x >= kth
        if dist.top_p < 1.0:
            masked = x if keep is None else x.masked_fill(~keep, float("-inf"))
            probs = torch.softmax(masked, dim=-1)
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            nucleus = torch.zeros_like(probs, dtype=torch.bool).scatter_(
                1, order, before < dist.top_p
            )
            keep = nucleus if keep is None else keep & nucleus
        if keep is not None:
            keep[torch.arange(n, device=x.device), targets] = True
    if keep is not None:
        x = x.masked_fill(~keep, float("-inf"))
    lsm = torch.log_softmax(x, dim=-1)  # (T, V)
    logp = lsm.gather(-1, targets[:, None])[:, 0]
    if not entropy:
        return logp, None
    finite = lsm if keep is None else lsm.masked_fill(~keep, 0.0)  # 0 * -inf would be NaN
    return logp, -(lsm.exp() * finite).sum(-1)
