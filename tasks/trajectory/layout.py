"""Token-level layout of a trajectory tree: arrays in DFS preorder.

``flatten(tree)`` turns the trie's segments into flat numpy arrays (token ids,
parent index, depth position, provenance, version, behaviour logprob per token)
plus per-node offsets, which the sampler weights and the packer cuts.

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class LaidOut(Protocol):
    """What `flatten` reads of a tree (`tasks.trajectory.tree.TrajectoryTree` is one): its
    virtual root, its nodes in DFS preorder (each with ``id``, ``parent``, ``start``,
    ``tokens``, ``prov``, ``version``, ``logprobs``, ``len``) and each call's end node.
    Named here so that the layout needs no import of the tree (no circle)."""

    root: Any

    def nodes(self) -> Sequence[Any]: ...

    def end_nodes(self) -> Mapping[str, Any]: ...


@dataclass
class FlatTree:
    """A tree laid out token by token in DFS preorder (parents before children).

    Token arrays have shape (N,); node arrays have shape (M,), indexed by preorder
    node index. ``parent_idx[i]`` is the token before ``i`` on its path (-1 at a
    root); ``positions[i]`` is the depth of ``i`` (0 at a root).
    """

    token_ids: np.ndarray  # (N,) int32
    parent_idx: np.ndarray  # (N,) int32
    positions: np.ndarray  # (N,) int32
    provenance: np.ndarray  # (N,) int8, codes into PROVENANCES
    versions: np.ndarray  # (N,) int64, -1 for non-policy tokens
    logprobs: np.ndarray  # (N,) float32, NaN for non-policy tokens
    node_offset: np.ndarray  # (M,) first token index of each node
    node_length: np.ndarray  # (M,)
    node_parent: np.ndarray  # (M,) preorder index of the parent node, -1 under the root
    node_size: np.ndarray  # (M,) number of nodes in the subtree (self included)
    node_ids: np.ndarray  # (M,) internal Node.id
    ends: dict[str, int]  # request id -> preorder index of its context's end node (-1: root)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    def is_ancestor_or_self(self, u: int, v: int) -> bool:
        """Whether preorder node ``u`` lies on the path to preorder node ``v``."""
        return u <= v < u + int(self.node_size[u])

    def path_nodes(self, m: int) -> list[int]:
        """Preorder indices of node ``m`` and its ancestors, root-most last."""
        out = []
        while m >= 0:
            out.append(m)
            m = int(self.node_parent[m])
        return out


def flatten(tree: LaidOut) -> FlatTree:
    """Token-level DFS-preorder layout of the whole tree (see ``FlatTree``)."""
    nodes = tree.nodes()
    m = len(nodes)
    pre = {n.id: i for i, n in enumerate(nodes)}
    length = np.fromiter((len(n) for n in nodes), np.int64, m)
    offset = np.zeros(m, np.int64)
    if m:
        np.cumsum(length[:-1], out=offset[1:])
    node_parent = np.fromiter(
        (pre[n.parent.id] if n.parent is not tree.root else -1 for n in nodes), np.int64, m
    )
    starts = np.fromiter((n.start for n in nodes), np.int64, m)
    n_tok = int(length.sum())
    if m:
        tokens = np.concatenate([n.tokens for n in nodes]).astype(np.int32)
    else:
        tokens = np.zeros(0, np.int32)
    idx = np.arange(n_tok, dtype=np.int64)
    parent_idx = idx - 1
    first_parent = np.where(
        node_parent >= 0,
        offset[np.maximum(node_parent, 0)] + length[np.maximum(node_parent, 0)] - 1,
        -1,
    )
    parent_idx[offset[length > 0]] = first_parent[length > 0]
    positions = np.repeat(starts - offset, length) + idx
    prov = np.repeat(np.fromiter((n.prov for n in nodes), np.int8, m), length)
    versions = np.repeat(np.fromiter((n.version for n in nodes), np.int64, m), length)
    lps = [
        n.logprobs if n.logprobs is not None else np.full(len(n), np.nan, np.float32) for n in nodes
    ]
    logprobs = np.concatenate(lps).astype(np.float32) if m else np.zeros(0, np.float32)
    size = np.ones(m, np.int64)
    for i in range(m - 1, -1, -1):
        p = node_parent[i]
        if p >= 0:
            size[p] += size[i]
    # a call with an empty context ends at the (virtual) root: -1
    ends = {rid: pre.get(node.id, -1) for rid, node in tree.end_nodes().items()}
    return FlatTree(
        token_ids=tokens,
        parent_idx=parent_idx.astype(np.int32),
        positions=positions.astype(np.int32),
        provenance=prov,
        versions=versions,
        logprobs=logprobs,
        node_offset=offset,
        node_length=length,
        node_parent=node_parent,
        node_size=size,
        node_ids=np.fromiter((n.id for n in nodes), np.int64, m),
        ends=ends,
    )
