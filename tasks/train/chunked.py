"""Chunked forward/backward of one packed tree: any path length, memory linear in n.

The packed tokens (topological order) are cut into chunks ``[a, b)`` of at most
``chunk`` tokens. Chunk k runs the decoder on its own tokens, with depth position ids,
over a cache pre-filled with the post-RoPE K/V of tokens ``[0, a)`` of every layer, and
tree attention restricted to its queries (``tree_attention.restrict``): ancestors precede
a token in topological order, so every key a token needs is in ``[0, b)`` and the result
is exact. Each chunk runs under ``torch.utils.checkpoint`` (non-reentrant) with the
earlier chunks' K/V passed as separate inputs and concatenated inside, so what stays
alive between forward and backward is the K/V of all chunks (linear in n) and the
chunk's outputs; the backward recomputes one chunk's activations at a time and sends
gradients into the earlier chunks' K/V through the concatenation.

A token's log-prob reads its parent's hidden state: chunk k returns the stats of the
selected tokens whose parent lies in ``[a, b)``; they are put back in ``sel`` order.

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from tasks.train import tree_attention
from tasks.train.logprobs import SamplingDist, token_logprobs


def _prefilled(prefix: list[list[torch.Tensor]], n_layers: int) -> DynamicCache:
    """A cache whose layer i holds cat(prefix[i][0::2]) / cat(prefix[i][1::2]) (or nothing)."""
    cache = DynamicCache()
    if prefix and prefix[0]:
        for i in range(n_layers):
            k = torch.cat(prefix[i][0::2], dim=-2)  # (1, Hkv, a, D)
            v = torch.cat(prefix[i][1::2], dim=-2)
            cache.update(k, v, i)
    return cache


def chunked_token_stats(
    model: torch.nn.Module,
    token_ids: np.ndarray,
    positions: np.ndarray,
    parent_idx: np.ndarray,
    sel: np.ndarray,
    chunk: int,
    device: str | torch.device = "cpu",
    dist: SamplingDist = SamplingDist(),
    *,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log q(token | path) (and H(q)) of tokens ``sel`` (T,) of one packed tree (N,),
    computed chunk by chunk (at most ``chunk`` tokens each) with checkpointing; equal to
    the one-forward ``packed_token_stats`` up to rounding."""
    tree_attention.enable(model)
    decoder = getattr(model, "model", None) or model.get_decoder()
    n_layers = model.config.num_hidden_layers
    n = len(token_ids)
    ids = torch.as_tensor(token_ids, device=device)[None]  # (1, N)
    pos = torch.as_tensor(positions, device=device)[None]  # (1, N)
    full = tree_attention.plan(parent_idx)
    parents = parent_idx[sel]
    grad = torch.is_grad_enabled()
    # a per-layer-type mapping skips transformers' (q, k) mask, which tree attention ignores
    types = getattr(model.config, "layer_types", None)
    mask_arg = {t: None for t in set(types)} if types else None
    prefix: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]  # [k0, v0, k1, v1, ...]
    logps, ents, order = [], [], []
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        mine = np.flatnonzero((parents >= a) & (parents < b))
        order.append(mine)
        rows = torch.as_tensor(parents[mine] - a, device=device)
        targets = ids[0, torch.as_tensor(sel[mine], device=device)]
        cplan = tree_attention.restrict(full, a, b).to(device)
        n_prev = len(prefix[0])

        def run(*flat, a=a, b=b, rows=rows, targets=targets, cplan=cplan, n_prev=n_prev):
            pre = [list(flat[i * n_prev : (i + 1) * n_prev]) for i in range(n_layers)]
            cache = _prefilled(pre, n_layers)
            out = decoder(
                input_ids=ids[:, a:b],
                position_ids=pos[:, a:b],
                cache=cache,
                use_cache=True,
                attention_mask=mask_arg,
                tree_plan=cplan,
            )
            hidden = out.last_hidden_state[0]  # (b - a, H)
            lp, en = token_logprobs(model.lm_head(hidden[rows]), targets, dist, entropy=entropy)
            new = []
            for layer in cache.layers:
                new += [layer.keys[:, :, a:b], layer.values[:, :, a:b]]  # (1, Hkv, b - a, D)
            return (lp, en if en is not None else lp.new_zeros(0), *new)

        flat = [t for layer in prefix for t in layer]
        if grad:
            res = checkpoint(run, *flat, use_reentrant=False)
        else:
            res = run(*flat)
        logps.append(res[0])
        ents.append(res[1])
        for i in range(n_layers):
            prefix[i] += [res[2 + 2 * i], res[3 + 2 * i]]
    inv = np.empty(len(sel), np.int64)
    inv[np.concatenate(order)] = np.arange(len(sel))
    inv_t = torch.as_tensor(inv, device=device)
    logp = torch.cat(logps)[inv_t]
    ent = torch.cat(ents)[inv_t] if entropy else None
    return logp, ent
