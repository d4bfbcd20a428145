"""Loss and gradients of packed trees (and of flat branches, the reference).

One forward per micro-batch over a packed tree: tokens in topological order,
``position_ids`` = depth in the path, and attention restricted to each token's
path, either chain by chain (``attention="tree"``, tasks/tree_attention.py: work
proportional to the sum of depths, as flat training over unique tokens) or with
a dense 4D ancestor mask handed to the model as ``attention_mask``
(``attention="dense"``: transformers passes a 4D mask to SDPA as is; bool, True =
attend; all N^2 scores computed). Every token sees exactly its own path, so its
logits equal those of a flat forward over that path, and each unique token is
computed once. FlexAttention would avoid the dense mask but has no backward on
CPU in torch 2.13.

Log-probabilities are taken only where needed: the hidden state of each
trainable token's parent goes through ``lm_head`` (T rows, not N).

``tree_loss_and_grads`` / ``flat_loss_and_grads`` are pure functions of a model
and samples (gradients accumulate in the model, no optimizer step); the
tree-vs-flat equivalence test and bench/tree_train.py compare them.

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tasks.train import losses, tree_attention
from tasks.train.packing import Packed, ancestor_mask, pack
from tasks.trajectory.sampler import Sample


class TrainerError(ValueError):
    """Invalid trainer settings or inputs."""


@dataclass(frozen=True)
class LossConfig:
    """Which loss and its constants (see tasks/losses.py)."""

    loss: str = "ppo_clip"  # ppo_clip | grpo | tis
    eps_low: float = 0.2
    eps_high: float = 0.28
    is_cap: float = 2.0

    def __post_init__(self) -> None:
        if self.loss not in losses.LOSSES:
            raise TrainerError(
                f"loss={self.loss!r} is unknown; use one of {', '.join(losses.LOSSES)}"
            )


def token_losses(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    weight_pos: torch.Tensor,
    weight_neg: torch.Tensor,
    cfg: LossConfig,
    is_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """(T,) per-token loss terms for ``cfg.loss``."""
    if cfg.loss == "tis":
        return losses.truncated_is_token_loss(
            logp, behaviour_logp, weight_pos, weight_neg, cap=cfg.is_cap
        )
    lo, hi = (cfg.eps_low, cfg.eps_low) if cfg.loss == "grpo" else (cfg.eps_low, cfg.eps_high)
    return losses.ppo_clip_token_loss(
        logp,
        behaviour_logp,
        weight_pos,
        weight_neg,
        eps_low=lo,
        eps_high=hi,
        is_mask=is_mask,
        is_cap=cfg.is_cap,
    )


def _rmsnorm_keep_fp64(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """RMSNorm that upcasts to float32 as transformers does, but never downcasts float64."""
    input_dtype = hidden_states.dtype
    compute = torch.float64 if input_dtype == torch.float64 else torch.float32
    h = hidden_states.to(compute)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(input_dtype)


def keep_norms_in_fp64(model: torch.nn.Module) -> int:
    """Patch the model's RMSNorm layers so that a float64 model stays float64.

    transformers' Qwen/Llama RMSNorm computes in float32 whatever the input dtype
    (meant as an upcast for half precision); in a float64 model that rounds every
    norm, and tree vs flat gradients then differ at ~1e-8 (a shared prefix's
    gradient is rounded once in the tree, once per branch flat). Returns the
    number of layers patched. No effect on float32/bf16 inputs.
    """
    n = 0
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm") and hasattr(mod, "variance_epsilon"):
            mod.forward = types.MethodType(_rmsnorm_keep_fp64, mod)
            n += 1
    return n


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "model", None) or model.get_decoder()


def _gather_logp(
    model: torch.nn.Module, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """log p(targets | hidden[rows]); hidden (N, H), rows/targets (T,) -> (T,)."""
    logits = model.lm_head(hidden[rows])  # (T, V)
    return torch.log_softmax(
        logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, -1
    ).gather(-1, targets[:, None])[:, 0]


def packed_logprobs(
    model: torch.nn.Module,
    packed: Packed,
    sel: np.ndarray,
    device: str | torch.device = "cpu",
    attention: str = "tree",
) -> torch.Tensor:
    """Current-policy log-probs of tokens ``sel`` (T,) of a packed micro-batch, shape (T,).

    One forward with depth position ids (1, N) and either the chain-wise tree
    attention (``attention="tree"``, tasks/tree_attention.py) or the dense
    ancestor mask (1, 1, N, N) through the model's own SDPA (``"dense"``).
    """
    ids = torch.as_tensor(packed.token_ids, device=device)[None]  # (1, N)
    pos = torch.as_tensor(packed.positions, device=device)[None]  # (1, N)
    if attention == "tree":
        tree_attention.enable(model)
        plan = tree_attention.plan(packed.parent_idx).to(device)
        out = _decoder(model)(input_ids=ids, position_ids=pos, tree_plan=plan)
    elif attention == "dense":
        mask = torch.as_tensor(ancestor_mask(packed.parent_idx), device=device)[None, None]
        if getattr(model.config, "_attn_implementation", "sdpa") not in (
            "sdpa",
            tree_attention.NAME,
        ):
            dtype = next(model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(
                ~mask, torch.finfo(dtype).min
            )
        out = _decoder(model)(input_ids=ids, attention_mask=mask, position_ids=pos)
    else:
        raise TrainerError(f"attention={attention!r}: use 'tree' or 'dense'")
    hidden = out.last_hidden_state[0]  # (N, H)
    rows = torch.as_tensor(packed.parent_idx[sel], device=device)
    return _gather_logp(model, hidden, rows, ids[0, torch.as_tensor(sel, device=device)])


def _is_mask(
    versions: np.ndarray, min_version: int | None, device: str | torch.device
) -> torch.Tensor | None:
    if min_version is None:
        return None
    return torch.as_tensor((versions >= 0) & (versions < min_version), device=device)


def tree_loss_and_grads(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    *,
    cfg: LossConfig,
    normalizer: float,
    max_tokens: int = 4096,
    min_version: int | None = None,
    device: str | torch.device = "cpu",
    backward: bool = True,
    attention: str = "tree",
) -> dict[str, float]:
    """Tree-packed loss over ``samples``, gradients accumulated into ``model`` (no step).

    Tokens with a policy version below ``min_version`` use truncated IS. Returns
    plain metrics: loss, tokens (forwarded), trainable (weighted tokens), micro
    batches, clip fraction.
    """
    total = 0.0
    n_tok = n_train = 0
    clipped = 0.0
    packs = pack(samples, max_tokens)
    for p in packs:
        sel = np.flatnonzero(((p.weight_pos != 0) | (p.weight_neg != 0)) & (p.parent_idx >= 0))
        n_tok += p.n_tokens
        if not sel.size:
            continue
        logp = packed_logprobs(model, p, sel, device, attention)
        dt = logp.dtype
        blp = torch.as_tensor(p.behaviour_logprobs[sel], dtype=dt, device=device)
        wp = torch.as_tensor(p.weight_pos[sel], dtype=dt, device=device)
        wn = torch.as_tensor(p.weight_neg[sel], dtype=dt, device=device)
        loss = (
            token_losses(
                logp, blp, wp, wn, cfg, _is_mask(p.versions[sel], min_version, device)
            ).sum()
            / normalizer
        )
        if backward:
            loss.backward()
        total += float(loss.detach())
        n_train += sel.size
        clipped += (
            losses.clip_fraction(logp, blp, wp, wn, eps_low=cfg.eps_low, eps_high=cfg.eps_high)
            * sel.size
        )
    return {
        "loss": total,
        "tokens": float(n_tok),
        "trainable_tokens": float(n_train),
        "micro_batches": float(len(packs)),
        "clip_fraction": clipped / n_train if n_train else 0.0,
    }


def flat_loss_and_grads(
    model: torch.nn.Module,
    branches: Sequence[Sample],
    *,
    cfg: LossConfig,
    normalizer: float,
    min_version: int | None = None,
    device: str | torch.device = "cpu",
    backward: bool = True,
) -> dict[str, float]:
    """The reference: every branch (a chain sample, ``parent_idx[i] == i - 1``) is a
    plain causal sequence forwarded on its own with the model's default mask and
    positions. Same loss terms and normaliser as ``tree_loss_and_grads``."""
    total = 0.0
    n_tok = 0
    for b in branches:
        n = b.n_tokens
        if np.any(b.parent_idx != np.arange(n) - 1):
            raise TrainerError(
                f"branch {b.sample_id} is not a chain: flat branches need parent_idx = i - 1"
            )
        sel = np.flatnonzero(((b.weight_pos != 0) | (b.weight_neg != 0)) & (b.parent_idx >= 0))
        n_tok += n
        if not sel.size:
            continue
        ids = torch.as_tensor(b.token_ids.astype(np.int64), device=device)[None]  # (1, L)
        hidden = _decoder(model)(input_ids=ids).last_hidden_state[0]  # (L, H)
        logp = _gather_logp(
            model, hidden, torch.as_tensor(sel - 1, device=device), ids[0, torch.as_tensor(sel)]
        )
        dt = logp.dtype
        blp = torch.as_tensor(b.behaviour_logprobs[sel], dtype=dt, device=device)
        wp = torch.as_tensor(b.weight_pos[sel], dtype=dt, device=device)
        wn = torch.as_tensor(b.weight_neg[sel], dtype=dt, device=device)
        loss = (
            token_losses(
                logp, blp, wp, wn, cfg, _is_mask(b.versions[sel], min_version, device)
            ).sum()
            / normalizer
        )
        if backward:
            loss.backward()
        total += float(loss.detach())
    return {"loss": total, "tokens": float(n_tok)}
