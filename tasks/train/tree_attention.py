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

from tasks.train import split_attention

NAME = "gyre_tree"
BLOCK = 256


@dataclass
class Block:
    """Queries ``[q_lo, q_hi)`` (absolute) see the chain's first ``n_keys`` keys.

    The mask is computed when the block runs (``mask``), never stored: a plan of a long
    path would otherwise hold n^2/2 bytes of masks."""

    q_lo: int
    q_hi: int
    n_keys: int
    diag: int  # query row r sees keys [0, r + diag]

    @property
    def mask(self) -> torch.Tensor:
        """(q_hi - q_lo, n_keys) bool, True = attend."""
        return torch.ones(self.q_hi - self.q_lo, self.n_keys, dtype=torch.bool).tril(self.diag)


@dataclass
class Chain:
    """Tokens ``[start, end)``; ``keys`` = ancestor path + the chain (None: a root chain).

    A chain whose keys are one contiguous run holds only ``key_range`` (its keys are
    ``arange(*key_range)``, built when asked for): the plans of a long path's chunks would
    otherwise hold O(n) indices each, O(n^2 / chunk) over the path."""

    start: int
    end: int
    gathered: torch.Tensor | None  # (P + L,) long, where the keys are not contiguous
    blocks: list[Block] = field(default_factory=list)
    key_range: tuple[int, int] | None = None  # keys == arange(*key_range): slice, no gather

    @property
    def keys(self) -> torch.Tensor | None:
        if self.gathered is None and self.key_range is not None:
            return torch.arange(*self.key_range)
        return self.gathered

    @property
    def is_root(self) -> bool:
        """A root chain: plain causal over its own tokens, no ancestors."""
        return self.gathered is None and self.key_range is None

    @property
    def n_keys(self) -> int:
        """How many keys the chain attends to (0: a root chain, its own tokens)."""
        if self.gathered is not None:
            return len(self.gathered)
        return 0 if self.key_range is None else self.key_range[1] - self.key_range[0]

    @property
    def mask(self) -> torch.Tensor | None:
        """(L, P + L) bool: the chain's whole pattern (for checks; blocks are what runs)."""
        if self.is_root:
            return None
        n = self.n_keys
        rows = [torch.nn.functional.pad(b.mask, (0, n - b.n_keys)) for b in self.blocks]
        return torch.cat(rows, 0)


@dataclass
class TreePlan:
    """Chains covering ``[0, N)`` in order."""

    chains: list[Chain]
    n_tokens: int  # keys are tokens [0, n_tokens)
    q_start: int = 0  # queries are tokens [q_start, n_tokens) (a chunk: ``restrict``)

    def to(self, device: torch.device | str) -> TreePlan:
        if torch.device(device).type == "cpu":
            return self
        chains = [
            Chain(
                c.start,
                c.end,
                None if c.gathered is None else c.gathered.to(device),
                c.blocks,
                c.key_range,
            )
            for c in self.chains
        ]
        return TreePlan(chains, self.n_tokens, self.q_start)


def _blocks(q_lo: int, q_hi: int, s: int, depth: int, block: int) -> list[Block]:
    """Query blocks of chain rows ``[q_lo, q_hi)`` of a chain starting at ``s`` below a path
    of ``depth`` keys: block ``[lo, hi)`` sees the chain's keys up to ``hi``."""
    return [
        Block(lo, min(q_hi, lo + block), depth + min(q_hi, lo + block) - s, depth + lo - s)
        for lo in range(q_lo, q_hi, block)
    ]


def restrict(tp: TreePlan, a: int, b: int, block: int | None = None) -> TreePlan:
    """The plan of queries ``[a, b)`` over keys ``[0, b)`` (one chunk of a topological order:
    every key a query needs precedes it, so it lies in ``[0, b)``)."""
    block = block or BLOCK
    chains = []
    for c in tp.chains:
        lo, hi = max(c.start, a), min(c.end, b)
        if lo >= hi:
            continue
        if c.is_root and lo == c.start:
            chains.append(Chain(lo, hi, None))
            continue
        depth = 0 if c.is_root else c.n_keys - (c.end - c.start)
        if c.is_root:
            keys, kr = None, (c.start, hi)
        elif c.gathered is None:
            keys, kr = None, (c.key_range[0], hi)
        else:
            keys, kr = c.gathered[: depth + hi - c.start], None
        chains.append(Chain(lo, hi, keys, _blocks(lo, hi, c.start, depth, block), kr))
    return TreePlan(chains, b, a)


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
        contiguous = bool(path[-1] == s - 1 and path[-1] - path[0] == depth - 1)
        if contiguous:
            keys, kr = None, (int(path[0]), e)
        else:
            keys, kr = torch.from_numpy(np.concatenate([path, np.arange(s, e)])), None
        chains.append(Chain(s, e, keys, _blocks(s, e, s, depth, block), kr))
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
    """transformers attention function: query (1, H, N - q_start, D), key/value
    (1, Hkv, N, D) -> (1, N - q_start, H, D). Falls back to SDPA when no ``tree_plan`` is given."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if tree_plan is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    q0 = tree_plan.q_start
    if (
        query.shape[0] != 1
        or query.shape[2] != tree_plan.n_tokens - q0
        or key.shape[2] != tree_plan.n_tokens
    ):
        raise ValueError(
            f"tree attention takes queries [{q0}, {tree_plan.n_tokens}) over keys "
            f"[0, {tree_plan.n_tokens}), got query {tuple(query.shape)}, key {tuple(key.shape)}"
        )
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for c in tree_plan.chains:
        if c.is_root:
            o = F.scaled_dot_product_attention(
                query[:, :, c.start - q0 : c.end - q0],
                key[:, :, c.start : c.end],
                value[:, :, c.start : c.end],
                dropout_p=dropout,
                scale=scaling,
                is_causal=c.end - c.start > 1,
                enable_gqa=gqa,
            )
            outs.append(o)
            continue
        k, v = chain_keys(c, key, value)
        outs += attend_blocks(query, k, v, c.blocks, q0, dropout, scaling, gqa)
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]  # (1, H, N, D)
    return out.transpose(1, 2).contiguous(), None


def chain_keys(c: Chain, key: torch.Tensor, value: torch.Tensor):
    """The keys/values (1, Hkv, P + L, D) a keyed chain attends to: views of a contiguous
    ``key_range``, else gathered by index."""
    if c.key_range is not None:
        k0, k1 = c.key_range
        return key[:, :, k0:k1], value[:, :, k0:k1]
    keys = c.gathered.to(key.device)
    return key.index_select(2, keys), value.index_select(2, keys)


def attend_blocks(
    query: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: list[Block],
    q0: int,
    dropout: float,
    scaling: float | None,
    gqa: bool,
) -> list[torch.Tensor]:
    """Attention of each query block (rows ``[q_lo - q0, q_hi - q0)`` of ``query``) over the
    first ``n_keys`` of ``k``/``v`` under its mask; the outputs (1, H, rows, D) in order.

    The blocks of one chain span rows ``[lo, hi)`` that see an unmasked prefix of
    ``blocks[0].diag`` keys and then their own keys causally, so where
    ``split_attention`` runs they go as one call of it (two fused kernels, no mask)."""
    if blocks and split_attention.available(query, dropout):
        lo, hi, n_prefix = blocks[0].q_lo, blocks[-1].q_hi, blocks[0].diag
        n_keys = n_prefix + hi - lo
        q = query[:, :, lo - q0 : hi - q0]
        return [
            split_attention.prefix_causal(q, k[:, :, :n_keys], v[:, :, :n_keys], n_prefix, scaling)
        ]
    return [
        F.scaled_dot_product_attention(
            query[:, :, b.q_lo - q0 : b.q_hi - q0],
            k[:, :, : b.n_keys],
            v[:, :, : b.n_keys],
            attn_mask=b.mask.to(query.device),
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=gqa,
        )
        for b in blocks
    ]


def enable(model: torch.nn.Module) -> None:
    """Register ``gyre_tree`` and switch ``model`` to it (idempotent).

    Registers every time: a re-imported module (a reload, a test copy) must not leave the
    global registry pointing at an older function."""
    from transformers import AttentionInterface

    if AttentionInterface._global_mapping.get(NAME) is not tree_attention_forward:
        AttentionInterface.register(NAME, tree_attention_forward)
    if getattr(model.config, "_attn_implementation", None) != NAME:
        model.set_attn_implementation(NAME)
