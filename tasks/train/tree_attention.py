"""Tree attention for transformers models: each chain of tokens attends to its path only.

A dense (N, N) ancestor mask makes SDPA compute all N^2 scores of a packed
micro-batch, although a token needs only its own path: for a tree of wide
branches that is many times the work of training the branches flat. Here the
packed tokens are cut into *chains* (maximal runs where every token's parent is
the token before it). A root chain is plain causal attention. A chain ``[s, e)``
hanging below ancestor path ``P`` (indices, ascending) attends to keys
``P + [s, e)`` with the causal pattern shifted by ``len(P)``; its keys/values are
gathered once, and its queries go in blocks of at most ``block`` tokens, block
``j`` seeing only the keys up to its own end, so the work is about the sum over
tokens of their depth (what flat training of the unique tokens would cost), not
``L x (P + L)`` per chain.

Use: ``enable(model)`` once (registers the ``gyre_tree`` attention function with
transformers' ``AttentionInterface`` and switches the model to it), then call the
decoder with ``attention_mask=None`` and ``tree_plan=plan(parent_idx)``. Without a
plan the function is plain SDPA, so generation and flat forwards are unchanged.

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

NAME = "gyre_tree"
BLOCK = 256


@dataclass
class Block:
    """Queries ``[q_lo, q_hi)`` (absolute) see the chain's first ``n_keys`` keys."""

    q_lo: int
    q_hi: int
    n_keys: int
    mask: torch.Tensor  # (q_hi - q_lo, n_keys) bool, True = attend


@dataclass
class Chain:
    """Tokens ``[start, end)``; ``keys`` = ancestor path + the chain (None: a root chain)."""

    start: int
    end: int
    keys: torch.Tensor | None  # (P + L,) long
    blocks: list[Block] = field(default_factory=list)

    @property
    def mask(self) -> torch.Tensor | None:
        """(L, P + L) bool: the chain's whole pattern (for checks; blocks are what runs)."""
        if self.keys is None:
            return None
        n = len(self.keys)
        rows = [torch.nn.functional.pad(b.mask, (0, n - b.n_keys)) for b in self.blocks]
        return torch.cat(rows, 0)


@dataclass
class TreePlan:
    """Chains covering ``[0, N)`` in order."""

    chains: list[Chain]
    n_tokens: int

    def to(self, device: torch.device | str) -> TreePlan:
        if torch.device(device).type == "cpu":
            return self
        chains = [
            Chain(
                c.start,
                c.end,
                None if c.keys is None else c.keys.to(device),
                [Block(b.q_lo, b.q_hi, b.n_keys, b.mask.to(device)) for b in c.blocks],
            )
            for c in self.chains
        ]
        return TreePlan(chains, self.n_tokens)


def plan(parent_idx: np.ndarray, block: int | None = None) -> TreePlan:
    """Chains (and query blocks of at most ``block``, default ``BLOCK``) of a topologically
    ordered tree layout ``parent_idx`` (N,)."""
    block = block or BLOCK
    n = len(parent_idx)
    idx = np.arange(n)
    starts = np.flatnonzero(parent_idx != idx - 1)
    if n and (not starts.size or starts[0] != 0):
        starts = np.concatenate([[0], starts])
    ends = np.append(starts[1:], n)
    chain_of = np.repeat(np.arange(len(starts)), ends - starts)
    paths: list[np.ndarray] = []
    chains = []
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        p = int(parent_idx[s])
        if p < 0:
            path = np.zeros(0, np.int64)
        else:  # the parent's chain: its path, then its tokens up to p
            pc = int(chain_of[p])
            path = np.concatenate([paths[pc], np.arange(starts[pc], p + 1)])
        paths.append(path)
        if not path.size:
            chains.append(Chain(s, e, None))
            continue
        depth = len(path)
        keys = torch.from_numpy(np.concatenate([path, np.arange(s, e)]))
        blocks = []
        for lo in range(s, e, block):
            hi = min(e, lo + block)
            n_keys = depth + hi - s
            mask = torch.ones(hi - lo, n_keys, dtype=torch.bool).tril(diagonal=depth + lo - s)
            blocks.append(Block(lo, hi, n_keys, mask))
        chains.append(Chain(s, e, keys, blocks))
    return TreePlan(chains, n)


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    tree_plan: TreePlan | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query (1, H, N, D), key/value (1, Hkv, N, D)
    -> (1, N, H, D). Falls back to SDPA when no ``tree_plan`` is given."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if tree_plan is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1 or query.shape[2] != tree_plan.n_tokens:
        raise ValueError(
            f"tree attention takes one packed sequence of {tree_plan.n_tokens} tokens, "
            f"got query of shape {tuple(query.shape)}"
        )
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for c in tree_plan.chains:
        if c.keys is None:
            o = F.scaled_dot_product_attention(
                query[:, :, c.start : c.end],
                key[:, :, c.start : c.end],
                value[:, :, c.start : c.end],
                dropout_p=dropout,
                scale=scaling,
                is_causal=c.end - c.start > 1,
                enable_gqa=gqa,
            )
            outs.append(o)
            continue
        k, v = key.index_select(2, c.keys), value.index_select(2, c.keys)  # (1, Hkv, P + L, D)
        for b in c.blocks:
            o = F.scaled_dot_product_attention(
                query[:, :, b.q_lo : b.q_hi],
                k[:, :, : b.n_keys],
                v[:, :, : b.n_keys],
                attn_mask=b.mask,
                dropout_p=dropout,
                scale=scaling,
                enable_gqa=gqa,
            )
            outs.append(o)
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]  # (1, H, N, D)
    return out.transpose(1, 2).contiguous(), None


def enable(model: torch.nn.Module) -> None:
    """Register ``gyre_tree`` and switch ``model`` to it (idempotent).

    Registers every time: a re-imported module (a reload, a test copy) must not leave the
    global registry pointing at an older function."""
    from transformers import AttentionInterface

    if AttentionInterface._global_mapping.get(NAME) is not tree_attention_forward:
        AttentionInterface.register(NAME, tree_attention_forward)
    if getattr(model.config, "_attn_implementation", None) != NAME:
        model.set_attn_implementation(NAME)
