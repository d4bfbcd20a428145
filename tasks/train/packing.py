"""Packing trees into micro-batches under a token budget.

A micro-batch is one sequence of tokens holding one or more trees (or pieces of a
tree) in topological order, with ``parent_idx`` per token (-1 at roots),
``positions`` = depth in the token's path, and an ancestor attention mask: token
``i`` attends to ``j`` iff ``j`` is an ancestor of ``i`` or ``i`` itself. One
forward over it computes, for every token, exactly what a flat forward over that
token's path would.

Samples go into micro-batches first-fit decreasing by size. A tree larger than
the budget is cut into contiguous ranges of its DFS preorder; every parent of a
token in a range lies in the range or on the ancestor path of the range's first
token, so a piece is that ancestor path (repeated, zero loss weight) + the range.
The only duplicated work is one path per piece.

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from tasks.trajectory.sampler import Sample


class PackingError(ValueError):
    """A sample cannot fit the token budget (a single path is longer than the budget)."""


@dataclass
class Packed:
    """One micro-batch: pieces concatenated in order. Arrays have shape (N,)."""

    token_ids: np.ndarray  # int64
    parent_idx: np.ndarray  # int64, -1 at roots, indices into this micro-batch
    positions: np.ndarray  # int64
    weight_pos: np.ndarray  # float64
    weight_neg: np.ndarray  # float64
    behaviour_logprobs: np.ndarray  # float64
    versions: np.ndarray  # int64
    sample_ids: list[str]  # the pieces' sample ids, in order
    counts: np.ndarray | None = None  # int64, branches that train each token (0: context)

    def __post_init__(self) -> None:
        if self.counts is None:
            self.counts = ((self.weight_pos != 0) | (self.weight_neg != 0)).astype(np.int64)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    def attention_mask(self) -> np.ndarray:
        """(N, N) bool ancestor-or-self mask."""
        return ancestor_mask(self.parent_idx)


def ancestor_mask(parent_idx: np.ndarray) -> np.ndarray:
    """(N, N) bool: ``mask[i, j]`` iff ``j`` is an ancestor of ``i`` or ``j == i``.

    ``parent_idx`` (N,) must be topological (``parent_idx[i] < i``). Chain runs
    (``parent_idx[i] == i - 1``) are filled as lower triangles in one go.
    """
    n = len(parent_idx)
    mask = np.zeros((n, n), dtype=bool)
    i = 0
    while i < n:
        j = i + 1  # extend the run of tokens that continue their predecessor
        while j < n and parent_idx[j] == j - 1:
            j += 1
        p = parent_idx[i]
        if p >= 0:
            mask[i:j, :] = mask[p]
        mask[i:j, i:j] = np.tri(j - i, dtype=bool)
        i = j
    return mask


def _run_start(parent_idx: np.ndarray) -> np.ndarray:
    """(N,) index where the chain run containing each token starts."""
    n = len(parent_idx)
    idx = np.arange(n)
    starts = np.where(parent_idx != idx - 1, idx, 0)
    return np.maximum.accumulate(starts) if n else starts


def ancestors(parent_idx: np.ndarray, i: int, run_start: np.ndarray | None = None) -> np.ndarray:
    """Strict ancestors of token ``i``, ascending; walks chain runs, not tokens."""
    rs = _run_start(parent_idx) if run_start is None else run_start
    parts = []
    j = int(parent_idx[i])
    while j >= 0:
        s = int(rs[j])
        parts.append(np.arange(s, j + 1))
        j = int(parent_idx[s])
    if not parts:
        return np.zeros(0, np.int64)
    return np.concatenate(parts[::-1])


def _take(sample: Sample, idx: np.ndarray, n_repeat: int, piece: int) -> Sample:
    """Sub-sample on sorted token indices ``idx``; the first ``n_repeat`` get zero weight."""
    local = np.searchsorted(idx, np.maximum(sample.parent_idx[idx], 0))
    parent = np.where(sample.parent_idx[idx] >= 0, local, -1)
    wp = sample.weight_pos[idx].copy()
    wn = sample.weight_neg[idx].copy()
    cnt = sample.counts[idx].copy()
    # the repeated ancestor path is context here: its tokens train in their own piece
    wp[:n_repeat] = 0.0
    wn[:n_repeat] = 0.0
    cnt[:n_repeat] = 0
    trainable = cnt > 0
    return replace(
        sample,
        sample_id=f"{sample.sample_id}#{piece}",
        token_ids=sample.token_ids[idx],
        parent_idx=parent.astype(np.int32),
        positions=sample.positions[idx],
        weight_pos=wp,
        weight_neg=wn,
        behaviour_logprobs=sample.behaviour_logprobs[idx],
        versions=sample.versions[idx],
        counts=cnt,
        n_tokens=len(idx),
        n_trainable=int(trainable.sum()),
        n_flat_tokens=0,
        n_flat_trainable=0,
    )


def partition(sample: Sample, max_tokens: int) -> list[Sample]:
    """Cut a sample into pieces of at most ``max_tokens`` tokens each.

    Each piece = the ancestor path of its first token (zero weight) + a contiguous
    preorder range. Returns ``[sample]`` when it fits. Raises ``PackingError`` when
    a token's path alone does not fit.
    """
    n = sample.n_tokens
    if n <= max_tokens:
        return [sample]
    pos = sample.positions
    rs = _run_start(sample.parent_idx)
    pieces = []
    a = 0
    while a < n:
        depth = int(pos[a])  # = number of strict ancestors of token a
        room = max_tokens - depth
        if room < 1:
            raise PackingError(
                f"sample {sample.sample_id}: a path reaches depth {depth + 1} > "
                f"max_tokens_per_micro={max_tokens}; raise max_tokens_per_micro to at least "
                f"{int(pos.max()) + 1}"
            )
        b = min(n, a + room)
        anc = ancestors(sample.parent_idx, a, rs)
        idx = np.concatenate([anc, np.arange(a, b)])
        pieces.append(_take(sample, idx, len(anc), len(pieces)))
        a = b
    return pieces


def first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each summing to at most ``capacity`` (items > capacity alone)."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, r in enumerate(room):
            if sizes[i] <= r:
                bins[b].append(i)
                room[b] -= sizes[i]
                break
        else:
            bins.append([i])
            room.append(capacity - sizes[i])
    return bins


def collate(pieces: Sequence[Sample]) -> Packed:
    """Concatenate pieces into one micro-batch (parent indices shifted)."""
    offs = np.cumsum([0] + [p.n_tokens for p in pieces])
    parent = np.concatenate(
        [
            np.where(p.parent_idx >= 0, p.parent_idx.astype(np.int64) + o, -1)
            for p, o in zip(pieces, offs, strict=False)
        ]
    )
    return Packed(
        token_ids=np.concatenate([p.token_ids for p in pieces]).astype(np.int64),
        parent_idx=parent,
        positions=np.concatenate([p.positions for p in pieces]).astype(np.int64),
        weight_pos=np.concatenate([p.weight_pos for p in pieces]).astype(np.float64),
        weight_neg=np.concatenate([p.weight_neg for p in pieces]).astype(np.float64),
        behaviour_logprobs=np.concatenate([p.behaviour_logprobs for p in pieces]).astype(
            np.float64
        ),
        versions=np.concatenate([p.versions for p in pieces]).astype(np.int64),
        sample_ids=[p.sample_id for p in pieces],
        counts=np.concatenate([p.counts for p in pieces]).astype(np.int64),
    )


def _pieces(sample: Sample, max_tokens: int) -> list[Sample]:
    """``partition``, or the whole sample when one of its paths is deeper than the budget."""
    if int(sample.positions.max()) + 1 > max_tokens:
        return [sample]
    return partition(sample, max_tokens)


def pack(samples: Sequence[Sample], max_tokens: int) -> list[Packed]:
    """Micro-batches of at most ``max_tokens`` tokens: big samples partitioned, then
    all pieces placed first-fit decreasing. A sample with a path deeper than ``max_tokens``
    cannot be partitioned: it becomes a micro-batch of its own, longer than ``max_tokens``,
    which the trainer runs in chunks of ``max_tokens`` (tasks/train/chunked.py)."""
    if max_tokens < 1:
        raise PackingError(f"max_tokens_per_micro={max_tokens} must be >= 1")
    pieces = [p for s in samples if s.n_tokens for p in _pieces(s, max_tokens)]
    bins = first_fit_decreasing([p.n_tokens for p in pieces], max_tokens)
    return [collate([pieces[i] for i in sorted(b)]) for b in bins]
