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
trainable token's parent goes through ``lm_head`` (T rows, not N), under the
rollouts' sampling processing (temperature, top-k, top-p; tasks/train/logprobs.py),
so the ratio to the engine's reported logprob is 1 at zero staleness.

Each trained token's loss is its policy-gradient term (weights summed over the
branches through it) plus, per branch through it (``Sample.counts``), the k3 KL to a
frozen reference policy and minus the entropy bonus (tasks/train/losses.py).

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
from tasks.train.chunked import chunked_token_stats
from tasks.train.logprobs import SamplingDist, token_logprobs
from tasks.train.packing import Packed, ancestor_mask, pack
from tasks.trajectory.sampler import Sample


class TrainerError(ValueError):
    """Invalid trainer settings or inputs."""


@dataclass(frozen=True)
class LossConfig:
    """Which loss and its constants (see tasks/train/losses.py)."""

    loss: str = "ppo_clip"  # ppo_clip | grpo | tis
    eps_low: float = 0.2
    eps_high: float = 0.28
    is_cap: float = 2.0
    kl_coef: float = 0.0  # k3 KL to the reference policy, per counted token
    entropy_coef: float = 0.0  # entropy bonus, per counted token

    def __post_init__(self) -> None:
        errors = []
        if self.loss not in losses.LOSSES:
            errors.append(f"loss={self.loss!r} is unknown; use one of {', '.join(losses.LOSSES)}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            errors.append(f"kl_coef={self.kl_coef}, entropy_coef={self.entropy_coef}: must be >= 0")
        if errors:
            raise TrainerError("; ".join(errors))

    @property
    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high) of the surrogate: ``grpo`` clips symmetrically at eps_low."""
        if self.loss == "grpo":
            return self.eps_low, self.eps_low
        return self.eps_low, self.eps_high


def token_losses(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    weight_pos: torch.Tensor,
    weight_neg: torch.Tensor,
    cfg: LossConfig,
    is_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """(T,) per-token policy-gradient terms for ``cfg.loss`` (no KL / entropy)."""
    if cfg.loss == "tis":
        return losses.truncated_is_token_loss(
            logp, behaviour_logp, weight_pos, weight_neg, cap=cfg.is_cap
        )
    lo, hi = cfg.clip_range
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


def _token_stats(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    dist: SamplingDist,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log q(targets | hidden[rows]) and H(q); hidden (N, H), rows/targets (T,) -> (T,) each."""
    logits = model.lm_head(hidden[rows])  # (T, V)
    return token_logprobs(logits, targets, dist, entropy=entropy)


def packed_token_stats(
    model: torch.nn.Module,
    packed: Packed,
    sel: np.ndarray,
    device: str | torch.device = "cpu",
    attention: str = "tree",
    dist: SamplingDist = SamplingDist(),
    *,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Current-policy log-probs (and entropies) of tokens ``sel`` (T,) of a packed micro-batch.

    One forward with depth position ids (1, N) and either the chain-wise tree
    attention (``attention="tree"``, tasks/train/tree_attention.py) or the dense
    ancestor mask (1, 1, N, N) through the model's own SDPA (``"dense"``). The
    log-probs are those of the processed distribution ``dist`` (temperature, top-k,
    top-p: tasks/train/logprobs.py), as the engine reported them.
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
    targets = ids[0, torch.as_tensor(sel, device=device)]
    return _token_stats(model, hidden, rows, targets, dist, entropy)


def packed_logprobs(
    model: torch.nn.Module,
    packed: Packed,
    sel: np.ndarray,
    device: str | torch.device = "cpu",
    attention: str = "tree",
    dist: SamplingDist = SamplingDist(),
) -> torch.Tensor:
    """Log-probs (T,) of tokens ``sel`` of a packed micro-batch (``packed_token_stats``)."""
    return packed_token_stats(model, packed, sel, device, attention, dist)[0]


def _is_mask(
    versions: np.ndarray, min_version: int | None, device: str | torch.device
) -> torch.Tensor | None:
    if min_version is None:
        return None
    return torch.as_tensor((versions >= 0) & (versions < min_version), device=device)


def _selected(counts: np.ndarray, wp: np.ndarray, wn: np.ndarray, parent: np.ndarray):
    """Indices of the tokens that carry a loss term: trained by some branch, with a parent."""
    return np.flatnonzero(((counts > 0) | (wp != 0) | (wn != 0)) & (parent >= 0))


class _Terms:
    """Loss terms of one micro-batch (or branch) and their running metric sums."""

    def __init__(self) -> None:
        self.loss = self.pg = 0.0
        self.n = self.n_ppo = self.clipped = self.n_is = 0
        self.count = self.kl = self.entropy = 0.0

    def add(
        self,
        model: torch.nn.Module,
        ref_model: torch.nn.Module | None,
        stats,  # callable(model, need_entropy) -> (logp, entropy | None)
        blp: np.ndarray,
        wp: np.ndarray,
        wn: np.ndarray,
        counts: np.ndarray,
        versions: np.ndarray,
        *,
        cfg: LossConfig,
        normalizer: float,
        min_version: int | None,
        device: str | torch.device,
        backward: bool,
    ) -> None:
        logp, ent = stats(model, cfg.entropy_coef != 0)
        dt = logp.dtype
        blp_t = torch.as_tensor(blp, dtype=dt, device=device)
        wp_t = torch.as_tensor(wp, dtype=dt, device=device)
        wn_t = torch.as_tensor(wn, dtype=dt, device=device)
        cnt_t = torch.as_tensor(counts, dtype=dt, device=device)
        is_mask = _is_mask(versions, min_version, device)
        pg = token_losses(logp, blp_t, wp_t, wn_t, cfg, is_mask)
        kl = None
        if ref_model is not None and cfg.kl_coef != 0:
            with torch.no_grad():
                ref_logp, _ = stats(ref_model, False)
            kl = losses.kl_k3(logp, ref_logp)
        tok = losses.regularised_token_loss(
            pg, cnt_t, kl=kl, kl_coef=cfg.kl_coef, entropy=ent, entropy_coef=cfg.entropy_coef
        )
        loss = tok.sum() / normalizer
        if backward:
            loss.backward()
        self.loss += float(loss.detach())
        self.pg += float(pg.detach().sum()) / normalizer
        self.n += len(blp)
        self.count += float(cnt_t.sum())
        if kl is not None:
            self.kl += float((kl.detach() * cnt_t).sum())
        if ent is not None:
            self.entropy += float((ent.detach() * cnt_t).sum())
        ppo = ~is_mask.cpu().numpy() if is_mask is not None else np.ones(len(blp), bool)
        if cfg.loss == "tis":
            ppo[:] = False
        self.n_is += int((~ppo).sum())
        if ppo.any():
            lo, hi = cfg.clip_range
            idx = torch.as_tensor(np.flatnonzero(ppo), device=device)
            n_clip, active = losses.clip_counts(
                logp[idx], blp_t[idx], wp_t[idx], wn_t[idx], eps_low=lo, eps_high=hi
            )
            self.clipped += n_clip
            self.n_ppo += active

    def add_rows(self, model, ref_model, stats, src, idx: np.ndarray, **kw) -> None:
        """``add`` for the tokens ``idx`` of ``src`` (a Packed micro-batch or a Sample: the
        same per-token arrays)."""
        self.add(
            model,
            ref_model,
            stats,
            src.behaviour_logprobs[idx],
            src.weight_pos[idx],
            src.weight_neg[idx],
            src.counts[idx],
            src.versions[idx],
            **kw,
        )

    def metrics(self) -> dict[str, float]:
        return {
            "loss": self.loss,
            "pg_loss": self.pg,
            "trainable_tokens": float(self.n),
            "clip_fraction": self.clipped / self.n_ppo if self.n_ppo else 0.0,
            "is_tokens": float(self.n_is),
            "kl": self.kl / self.count if self.count else 0.0,
            "entropy": self.entropy / self.count if self.count else 0.0,
        }


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
    dist: SamplingDist = SamplingDist(),
    ref_model: torch.nn.Module | None = None,
    cp_samples: Sequence[Sample] = (),
    cp_group=None,
) -> dict[str, float]:
    """Tree-packed loss over ``samples``, gradients accumulated into ``model`` (no step).

    ``cp_samples`` are trained context parallel with the other members of ``cp_group`` (a
    torch.distributed group; tasks/train/context_parallel.py): every member passes the same
    ones, holds a slice of each and scores the tokens whose parent is in its slice, so the
    sum of the members' gradients is the one-member gradient. Their forwarded tokens count
    as the member's slice.

    A micro-batch longer than ``max_tokens`` (a sample with a path deeper than it) runs in
    chunks of ``max_tokens`` tokens with per-chunk checkpointing (tasks/train/chunked.py):
    exact, memory linear in its length. Tokens with a policy version below ``min_version``
    use truncated IS. Log-probs are
    those of ``dist`` (the rollouts' sampling processing). ``ref_model`` (frozen) is the
    reference of the KL term (needed when ``cfg.kl_coef > 0``). Returns plain metrics:
    loss, pg_loss, tokens (forwarded), trainable_tokens (with a loss term), micro_batches,
    clip_fraction (of weighted clipped-surrogate tokens), is_tokens, kl and entropy
    (means per counted token; entropy only when ``cfg.entropy_coef > 0``).
    """
    if cfg.kl_coef and ref_model is None:
        raise TrainerError("kl_coef > 0 needs ref_model= the frozen reference policy")
    terms = _Terms()
    n_tok = 0
    packs = pack(samples, max_tokens)
    for p in packs:
        sel = _selected(p.counts, p.weight_pos, p.weight_neg, p.parent_idx)
        n_tok += p.n_tokens
        if not sel.size:
            continue

        def stats(m, need_entropy, p=p, sel=sel):
            if p.n_tokens > max_tokens:  # a path deeper than the budget: chunk by chunk
                return chunked_token_stats(
                    m,
                    p.token_ids,
                    p.positions,
                    p.parent_idx,
                    sel,
                    max_tokens,
                    device,
                    dist,
                    entropy=need_entropy,
                )
            return packed_token_stats(m, p, sel, device, attention, dist, entropy=need_entropy)

        terms.add_rows(
            model,
            ref_model,
            stats,
            p,
            sel,
            cfg=cfg,
            normalizer=normalizer,
            min_version=min_version,
            device=device,
            backward=backward,
        )
    for s in cp_samples:
        n_tok += _context_parallel_terms(
            terms,
            model,
            ref_model,
            s,
            cfg,
            normalizer,
            min_version,
            device,
            backward,
            dist,
            cp_group,
        )
    n_micro = len(packs) + len(cp_samples)
    return {**terms.metrics(), "tokens": float(n_tok), "micro_batches": float(n_micro)}


def _context_parallel_terms(
    terms: _Terms,
    model: torch.nn.Module,
    ref_model: torch.nn.Module | None,
    sample: Sample,
    cfg: LossConfig,
    normalizer: float,
    min_version: int | None,
    device: str | torch.device,
    backward: bool,
    dist: SamplingDist,
    group,
) -> int:
    """One sample's loss terms from this member's slice of it; returns the slice's tokens.

    Every member runs the same collectives (the forward of ``model``, then of ``ref_model``)
    whether or not its slice holds loss tokens."""
    import torch.distributed as tdist

    from tasks.train import context_parallel

    (p,) = pack([sample], max(1, sample.n_tokens))
    sel = _selected(p.counts, p.weight_pos, p.weight_neg, p.parent_idx)
    world, rank = tdist.get_world_size(group=group), tdist.get_rank(group=group)
    lo, hi = context_parallel.split(p.parent_idx, world)[rank]
    mine = sel[context_parallel.scored(p.parent_idx, sel, lo, hi)]

    def stats(m, need_entropy):
        logp, ent, _ = context_parallel.member_logprobs(
            m,
            p.token_ids,
            p.positions,
            p.parent_idx,
            sel,
            group,
            dist,
            entropy=need_entropy,
            device=device,
        )
        return logp, ent

    terms.add_rows(
        model,
        ref_model,
        stats,
        p,
        mine,
        cfg=cfg,
        normalizer=normalizer,
        min_version=min_version,
        device=device,
        backward=backward,
    )
    return hi - lo


def flat_loss_and_grads(
    model: torch.nn.Module,
    branches: Sequence[Sample],
    *,
    cfg: LossConfig,
    normalizer: float,
    min_version: int | None = None,
    device: str | torch.device = "cpu",
    backward: bool = True,
    dist: SamplingDist = SamplingDist(),
    ref_model: torch.nn.Module | None = None,
) -> dict[str, float]:
    """The project's flat baseline: every branch (a chain sample, ``parent_idx[i] == i - 1``)
    is a plain causal sequence forwarded on its own with the model's default mask and
    positions. Same loss terms and normaliser as ``tree_loss_and_grads``."""
    if cfg.kl_coef and ref_model is None:
        raise TrainerError("kl_coef > 0 needs ref_model= the frozen reference policy")
    terms = _Terms()
    n_tok = 0
    for b in branches:
        n = b.n_tokens
        if np.any(b.parent_idx != np.arange(n) - 1):
            raise TrainerError(
                f"branch {b.sample_id} is not a chain: flat branches need parent_idx = i - 1"
            )
        sel = _selected(b.counts, b.weight_pos, b.weight_neg, b.parent_idx)
        n_tok += n
        if not sel.size:
            continue
        ids = torch.as_tensor(b.token_ids.astype(np.int64), device=device)[None]  # (1, L)

        def stats(m, need_entropy, ids=ids, sel=sel):
            hidden = _decoder(m)(input_ids=ids).last_hidden_state[0]  # (L, H)
            rows = torch.as_tensor(sel - 1, device=device)
            targets = ids[0, torch.as_tensor(sel, device=device)]
            return _token_stats(m, hidden, rows, targets, dist, need_entropy)

        terms.add_rows(
            model,
            ref_model,
            stats,
            b,
            sel,
            cfg=cfg,
            normalizer=normalizer,
            min_version=min_version,
            device=device,
            backward=backward,
        )
    return {**terms.metrics(), "tokens": float(n_tok)}
