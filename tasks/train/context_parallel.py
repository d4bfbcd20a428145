"""Context parallel: one long packed sequence (a path or a tree) split over k members.

Member ``r`` of a ``torch.distributed`` group holds a contiguous slice ``[lo, hi)`` of the
packed topological order and runs the decoder on those tokens only (position ids = depth,
as in single-member training). At each layer the ``gyre_cp`` attention function gathers
the keys/values of all slices (``all_gather``; the backward all-reduces the gathered
gradient and keeps this member's slice, since gloo has no reduce_scatter) and attends the
member's queries to the tree pattern over the whole sequence's keys: a query sees its
ancestors and itself, per chain of the whole sequence's tree plan, never an N x N mask.

Loss: the token whose *parent* lies in a member's slice is scored there (its log-prob
reads the parent's hidden state). Each member divides by the whole batch's normaliser, so
the sum over members of the parameter gradients (``DPGroup.reduce_grads``) equals the
one-member gradient. Every member runs the same collectives (one all_gather per layer in
the forward, one all_reduce per layer in the backward), with or without loss tokens.

Pure module: torch.distributed only, no prefect, no dask, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tasks.train import tree_attention
from tasks.train.logprobs import SamplingDist, token_logprobs

NAME = "gyre_cp"


def split(parent_idx: np.ndarray, world: int) -> list[tuple[int, int]]:
    """Contiguous slices ``[lo, hi)`` of the packed order, one per member, balanced by
    attention work (a token attends to ``depth + 1`` keys). Needs ``N >= world``."""
    n = len(parent_idx)
    if n < world:
        raise ValueError(f"{n} tokens cannot be split over {world} members")
    depth = np.zeros(n, np.int64)
    for i, p in enumerate(parent_idx.tolist()):
        depth[i] = 0 if p < 0 else depth[p] + 1
    cum = np.cumsum(depth + 1)
    cuts = [0]
    for r in range(1, world):
        c = int(np.searchsorted(cum, cum[-1] * r / world)) + 1
        cuts.append(min(max(c, cuts[-1] + 1), n - (world - r)))
    cuts.append(n)
    return [(cuts[r], cuts[r + 1]) for r in range(world)]


@dataclass
class CPPlan:
    """What a member's attention needs: the whole sequence's tree plan and its slice."""

    plan: tree_attention.TreePlan
    lo: int
    hi: int
    sizes: list[int]  # tokens per member, in rank order
    group: object = None  # torch.distributed process group (None: the default group)


class _GatherSeq(torch.autograd.Function):
    """(1, H, n_r, D) per member -> (1, H, N, D): the slices concatenated in rank order."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], rank: int, group) -> torch.Tensor:
        ctx.sizes, ctx.rank, ctx.group = sizes, rank, group
        m = max(sizes)
        pad = F.pad(x, (0, 0, 0, m - x.shape[2])).contiguous()
        bufs = [torch.empty_like(pad) for _ in sizes]
        dist.all_gather(bufs, pad, group=group)
        return torch.cat([b[:, :, :s] for b, s in zip(bufs, sizes, strict=True)], dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = grad.contiguous()
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        lo = sum(ctx.sizes[: ctx.rank])
        return g[:, :, lo : lo + ctx.sizes[ctx.rank]], None, None, None


def gather_seq(x: torch.Tensor, cp: CPPlan) -> torch.Tensor:
    rank = dist.get_rank(group=cp.group)
    return _GatherSeq.apply(x, cp.sizes, rank, cp.group)


def cp_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cp: CPPlan | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query (1, H, n_r, D), key/value (1, Hkv, n_r, D) of
    this member's slice -> (1, n_r, H, D). Without ``cp`` it is tree attention / SDPA."""
    if cp is None:
        return tree_attention.tree_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    key, value = gather_seq(key, cp), gather_seq(value, cp)  # (1, Hkv, N, D)
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for c in cp.plan.chains:
        q_lo, q_hi = max(c.start, cp.lo), min(c.end, cp.hi)
        if q_lo >= q_hi:
            continue
        if c.is_root:  # a root chain: its own tokens, contiguous
            k, v, depth = key[:, :, c.start : c.end], value[:, :, c.start : c.end], 0
        else:
            k, v = tree_attention.chain_keys(c, key, value)
            depth = c.n_keys - (c.end - c.start)  # ancestors before the chain
        # query blocks of at most BLOCK rows, each masked over the keys it can see: a
        # member's slice of a long path never builds an (n_r, N) mask
        blocks = tree_attention._blocks(q_lo, q_hi, c.start, depth, tree_attention.BLOCK)
        outs += tree_attention.attend_blocks(query, k, v, blocks, cp.lo, dropout, scaling, gqa)
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]  # (1, H, n_r, D)
    return out.transpose(1, 2).contiguous(), None


def enable(model: torch.nn.Module) -> None:
    """Register ``gyre_cp`` and switch ``model`` to it (idempotent; flat/tree without cp)."""
    from transformers import AttentionInterface

    if AttentionInterface._global_mapping.get(NAME) is not cp_attention_forward:
        AttentionInterface.register(NAME, cp_attention_forward)
    if getattr(model.config, "_attn_implementation", None) != NAME:
        model.set_attn_implementation(NAME)


def member_logprobs(
    model: torch.nn.Module,
    token_ids: np.ndarray,
    positions: np.ndarray,
    parent_idx: np.ndarray,
    sel: np.ndarray,
    group=None,
    sampling: SamplingDist = SamplingDist(),
    *,
    entropy: bool = False,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor | None, np.ndarray]:
    """This member's share of log q(token | its path) (and H(q)) for loss tokens ``sel`` (T,).

    Returns (logp (T_r,), entropy (T_r,) or None, mask (T,) bool: which of ``sel`` this
    member scored, i.e. ``scored``). ``sampling``: the rollouts' processed distribution, as
    in single-member training. Every member must call this with the same arguments."""
    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    cuts = split(parent_idx, world)
    lo, hi = cuts[rank]
    tplan = tree_attention.plan(parent_idx).to(device)
    cp = CPPlan(tplan, lo, hi, [b - a for a, b in cuts], group)
    enable(model)
    ids = torch.as_tensor(token_ids[lo:hi], device=device)[None]  # (1, n_r)
    pos = torch.as_tensor(positions[lo:hi], device=device)[None]
    decoder = getattr(model, "model", None) or model.get_decoder()
    hidden = decoder(input_ids=ids, position_ids=pos, cp=cp).last_hidden_state[0]  # (n_r, H)
    mine = scored(parent_idx, sel, lo, hi)
    rows = torch.as_tensor(parent_idx[sel][mine] - lo, device=device)
    targets = torch.as_tensor(token_ids[sel[mine]], device=device)
    logp, ent = token_logprobs(model.lm_head(hidden[rows]), targets, sampling, entropy=entropy)
    return logp, ent, mine


def scored(parent_idx: np.ndarray, sel: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """(T,) bool: the loss tokens ``sel`` a member holding ``[lo, hi)`` scores (their parent's
    hidden state is in its slice)."""
    parents = parent_idx[sel]
    return (parents >= lo) & (parents < hi)
