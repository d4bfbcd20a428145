"""Radix (prefix) KV cache: a token trie whose edges carry the KV of their tokens.

Shared across requests and sessions: a new request reuses the KV of the longest cached prefix
of its input and only prefills the rest. Eviction is LRU over leaves under a token budget.
A running request pins the prefix it reads (`lock` / `unlock`, a reference count per node, as
SGLang's ``lock_ref``): eviction never drops a pinned node, whatever the budget asks.

KV layout of one edge: ``(L, 2, H_kv, n, D)`` (layers, key/value, kv heads, tokens, head dim).
Not thread-safe: the engine touches it from its scheduler thread only.
"""

from __future__ import annotations

import itertools

import torch


class _Node:
    __slots__ = ("children", "key", "kv", "last_access", "lock_ref", "parent")

    def __init__(self, key: tuple[int, ...], kv: torch.Tensor | None, parent: _Node | None):
        self.key = key  # token ids on the edge into this node
        self.kv = kv  # (L, 2, H, len(key), D); None for the root
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.last_access = 0
        self.lock_ref = 0  # running requests whose prefix runs through this node


def _common_len(a: tuple[int, ...], b: list[int] | tuple[int, ...], start: int) -> int:
    """Length of the common prefix of `a` and `b[start:]`."""
    n = min(len(a), len(b) - start)
    if tuple(b[start : start + n]) == a[:n]:
        return n
    for i in range(n):
        if a[i] != b[start + i]:
            return i
    return n


class RadixCache:
    """Prefix trie of KV tensors with an LRU token budget."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.root = _Node((), None, None)
        self.total_tokens = 0
        self.pinned_tokens = 0  # tokens on nodes with lock_ref > 0 (never evicted)
        self._clock = itertools.count(1)

    def match(self, ids: list[int] | tuple[int, ...]) -> tuple[int, torch.Tensor | None]:
        """Longest cached prefix of `ids`: (length, KV (L, 2, H, length, D) or None if 0)."""
        node, pos, parts = self.root, 0, []
        now = next(self._clock)
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = _common_len(child.key, ids, pos)
            child.last_access = now
            parts.append(child.kv[:, :, :, :n] if n < len(child.key) else child.kv)
            pos += n
            if n < len(child.key):
                break
            node = child
        while node is not None:  # keep ancestors at least as recent as their leaves
            node.last_access = now
            node = node.parent
        if pos == 0:
            return 0, None
        return pos, parts[0] if len(parts) == 1 else torch.cat(parts, dim=3)

    def prefix_len(self, ids: list[int] | tuple[int, ...]) -> int:
        """Length of the longest cached prefix of `ids`, without touching LRU order."""
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = _common_len(child.key, ids, pos)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def lock(self, ids: list[int] | tuple[int, ...]) -> _Node | None:
        """Pin the cached path of `ids` against eviction; returns the handle for `unlock`.

        A path ending inside an edge pins that whole edge. None when nothing is cached.
        """
        node, pos, last = self.root, 0, None
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = _common_len(child.key, ids, pos)
            if n == 0:
                break
            last, pos = child, pos + n
            if n < len(child.key):
                break
            node = child
        node = last
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self.pinned_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent
        return last

    def unlock(self, handle: _Node | None) -> None:
        """Release a `lock`. A handle from before a `flush` is ignored (its tree is gone)."""
        if handle is None:
            return
        top = handle
        while top.parent is not None:
            top = top.parent
        if top is not self.root:
            return
        node = handle
        while node is not self.root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "radix unlock without a matching lock"
            if node.lock_ref == 0:
                self.pinned_tokens -= len(node.key)
            node = node.parent

    def insert(self, ids: list[int] | tuple[int, ...], kv: torch.Tensor) -> int:
        """Insert `ids` with their KV ``(L, 2, H, len(ids), D)``; returns new tokens stored."""
        assert kv.shape[3] == len(ids), (kv.shape, len(ids))
        node, pos, now = self.root, 0, next(self._clock)
        node.last_access = now
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                leaf = _Node(tuple(ids[pos:]), kv[:, :, :, pos:].clone(), node)
                leaf.last_access = now
                node.children[ids[pos]] = leaf
                added = len(ids) - pos
                self.total_tokens += added
                self.evict()
                return added
            n = _common_len(child.key, ids, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, pos = child, pos + n
        return 0

    def _split(self, child: _Node, n: int) -> _Node:
        """Split `child`'s edge after `n` tokens; returns the new upper node."""
        parent = child.parent
        upper = _Node(child.key[:n], child.kv[:, :, :, :n].clone(), parent)
        upper.last_access = child.last_access
        upper.lock_ref = child.lock_ref  # both halves carry the locks of the whole edge
        parent.children[child.key[0]] = upper
        child.key = child.key[n:]
        child.kv = child.kv[:, :, :, n:].clone()
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def evict(self, max_tokens: int | None = None) -> int:
        """Drop least recently used unpinned leaves until the cache holds <= budget tokens.

        Stops short of the budget when only pinned nodes are left; returns the tokens freed.
        """
        budget = self.max_tokens if max_tokens is None else max_tokens
        freed = 0
        while self.total_tokens > budget:
            leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
            if not leaves:
                break
            leaves.sort(key=lambda n: n.last_access)
            for leaf in leaves:
                if self.total_tokens <= budget:
                    break
                del leaf.parent.children[leaf.key[0]]
                self.total_tokens -= len(leaf.key)
                freed += len(leaf.key)
        return freed

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def flush(self) -> None:
        """Drop everything, pinned nodes included (their lockers' handles go stale)."""
        self.root = _Node((), None, None)
        self.total_tokens = 0
        self.pinned_tokens = 0

    def num_nodes(self) -> int:
        return sum(1 for _ in self._nodes())
