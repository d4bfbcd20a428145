"""Trajectory trees: a session's model calls merged by token prefix.

A session's TITO records form a tree of contexts: every call's input is (a prefix
of) an earlier call's input + output, followed by new tokens. Retries, rollbacks
and context resets share a shorter prefix and so become branches. This module
keeps that tree as a compressed token trie (single-child chains merged into
segments, one ``Node`` per segment, tokens in numpy arrays) and grows it
incrementally as records arrive.

Building never reconstructs a call's full input: a record with parent ``p`` and
``prefix_len k`` attaches at token depth ``k`` on ``p``'s path (input + output);
that point is found by walking ``p``'s path upwards from its end, which is cheap
because agents extend their most recent context. Cost is O(new tokens + nodes
walked) per record, so a rollout's tree costs O(unique tokens), not O(sum of
contexts).

Provenance: a record's ``output_ids`` are ``policy`` tokens (its
``weight_version``, its logprobs); its ``new_input_ids`` are ``harness`` tokens
unless spans mark parts as ``tool`` or ``env``. A node never mixes provenance or
policy version: children are keyed by (first token, provenance, version), so the
same tokens with a different provenance or version are a sibling branch, never a
shared node (training them as shared would change what flat training computes).

Pure module: no prefect, no distributed, no I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from storage.tito import TitoRecord
from tasks.trajectory.layout import FlatTree, flatten

log = logging.getLogger(__name__)

PROVENANCES = ("policy", "harness", "tool", "env")
POLICY, HARNESS, TOOL, ENV = 0, 1, 2, 3
_PROV_CODE = {name: i for i, name in enumerate(PROVENANCES)}

Span = tuple[int, int, str]  # (start, end) into new_input_ids, provenance name


class TreeError(ValueError):
    """A record cannot be placed: wrong session, unknown parent, bad prefix or spans."""


class Node:
    """One segment of the trie: tokens sharing provenance, version and branch set.

    ``start`` is the token depth of the first token (its position in every path
    through it); ``ends`` are the request ids whose context ends at this node's end.
    """

    __slots__ = (
        "children",
        "ends",
        "id",
        "logprobs",
        "parent",
        "prov",
        "start",
        "tokens",
        "version",
    )

    def __init__(
        self,
        node_id: int,
        parent: Node | None,
        tokens: np.ndarray,
        start: int,
        prov: int,
        version: int,
        logprobs: np.ndarray | None,
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.tokens = tokens  # (L,) int32
        self.start = start
        self.prov = prov
        self.version = version
        self.logprobs = logprobs  # (L,) float32 for policy nodes, else None
        self.children: dict[tuple[int, int, int], Node] = {}
        self.ends: list[str] = []

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def key(self) -> tuple[int, int, int]:
        return (int(self.tokens[0]), self.prov, self.version)

    def __repr__(self) -> str:
        return (
            f"Node(id={self.id}, start={self.start}, len={len(self)}, "
            f"prov={PROVENANCES[self.prov]}, v={self.version}, children={len(self.children)})"
        )


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    if a[0] != b[0]:  # the usual case at a branch point: skip the vector compare
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class TrajectoryTree:
    """The trajectory tree of one session, built incrementally from TITO records.

    Records of the session arrive in ``seq_no`` order (a parent before its
    children); ``add`` places each one. A sub-agent session keeps its own tree
    and names the session (and call) that spawned it in ``parent_session_id`` /
    ``parent_request_id``.
    """

    def __init__(
        self,
        session_id: str,
        *,
        run_id: str = "",
        parent_session_id: str | None = None,
        parent_request_id: str | None = None,
    ) -> None:
        self.session_id = session_id
        self.run_id = run_id
        self.parent_session_id = parent_session_id
        self.parent_request_id = parent_request_id
        self.root = Node(-1, None, np.zeros(0, np.int32), 0, HARNESS, -1, None)
        self._next_id = 0
        self._end: dict[str, Node] = {}  # request id -> node its context (input + output) ends in
        self._end_depth: dict[str, int] = {}
        self.n_tokens = 0  # unique tokens held
        self.n_flat_tokens = 0  # sum over calls of len(input) + len(output)
        self.request_ids: list[str] = []

    # ---- building -----------------------------------------------------------------

    def add(self, record: TitoRecord, spans: Sequence[Span] | None = None) -> None:
        """Place one record. ``spans`` (or ``record.extra['input_spans']``) mark
        ``(start, end, provenance)`` ranges of ``new_input_ids`` as ``tool``/``env``;
        the rest of the new input is ``harness``. Re-adding a known request id is a
        no-op (replayed logs)."""
        rid = record.request_id
        if record.session_id != self.session_id:
            raise TreeError(
                f"record {rid!r} belongs to session {record.session_id!r}, "
                f"not {self.session_id!r}: build one tree per session (build_trees)"
            )
        if rid in self._end:
            log.debug("record %s already in tree %s; skipped", rid, self.session_id)
            return
        new = np.asarray(record.new_input_ids, dtype=np.int32)
        out = np.asarray(record.output_ids, dtype=np.int32)
        k = int(record.prefix_len)
        # validate everything before the trie changes
        if spans is None:
            spans = record.extra.get("input_spans") if record.extra else None
        segments = _input_segments(len(new), spans, rid)
        lp = np.asarray(record.output_logprobs, dtype=np.float32)
        if len(lp) == 0:
            lp = np.full(len(out), np.nan, np.float32)
        elif len(lp) != len(out):
            raise TreeError(f"record {rid!r}: {len(lp)} output_logprobs for {len(out)} output_ids")
        node, off = self._locate(record.parent_request_id, k, rid)
        for lo, hi, prov in segments:
            node, off = self._insert(node, off, new[lo:hi], prov, -1, None)
        if len(out):
            node, off = self._insert(node, off, out, POLICY, int(record.weight_version), lp)
        if off < len(node):  # the context ends inside a segment: cut it there
            node = self._split(node, off)
        node.ends.append(rid)
        self._end[rid] = node
        depth = k + len(new) + len(out)
        self._end_depth[rid] = depth
        self.n_flat_tokens += depth
        self.request_ids.append(rid)

    def extend(
        self, records: Iterable[TitoRecord], spans: Mapping[str, Sequence[Span]] | None = None
    ) -> None:
        """``add`` each record in order (``spans`` keyed by request id)."""
        for r in records:
            self.add(r, spans.get(r.request_id) if spans else None)

    def _locate(self, parent_rid: str | None, k: int, rid: str) -> tuple[Node, int]:
        """The point after token ``k - 1`` on the parent's path, as (node, offset)."""
        if parent_rid is None:
            if k != 0:
                raise TreeError(f"root record {rid!r} has prefix_len {k} (expected 0)")
            return self.root, 0
        node = self._end.get(parent_rid)
        if node is None:
            raise TreeError(
                f"record {rid!r} names parent {parent_rid!r}, which is not in session "
                f"{self.session_id!r} yet: add records in seq_no order"
            )
        if k < 0 or k > self._end_depth[parent_rid]:
            raise TreeError(
                f"record {rid!r}: prefix_len {k} outside parent context "
                f"[0, {self._end_depth[parent_rid]}]"
            )
        while node.start >= k and node is not self.root:  # token k-1 lies above this node
            node = node.parent  # type: ignore[assignment]
        return node, k - node.start

    def _new_node(
        self, parent: Node, tokens: np.ndarray, prov: int, version: int, lp: np.ndarray | None
    ) -> Node:
        n = Node(self._next_id, parent, tokens, parent.start + len(parent), prov, version, lp)
        self._next_id += 1
        parent.children[n.key] = n
        self.n_tokens += len(tokens)
        return n

    def _split(self, node: Node, off: int) -> Node:
        """Cut ``node`` after ``off`` tokens; returns the new head. The tail keeps the
        node's identity so that references to it (record ends, children) stay valid."""
        assert 0 < off < len(node)
        parent = node.parent
        assert parent is not None
        head = Node(
            self._next_id,
            parent,
            node.tokens[:off],
            node.start,
            node.prov,
            node.version,
            None if node.logprobs is None else node.logprobs[:off],
        )
        self._next_id += 1
        parent.children[head.key] = head  # same key as the old node: same first token
        node.tokens = node.tokens[off:]
        if node.logprobs is not None:
            node.logprobs = node.logprobs[off:]
        node.start += off
        node.parent = head
        head.children[node.key] = node
        return head

    def _insert(
        self,
        node: Node,
        off: int,
        tokens: np.ndarray,
        prov: int,
        version: int,
        lp: np.ndarray | None,
    ) -> tuple[Node, int]:
        """Walk/extend the trie from point (node, off) along ``tokens``; returns the end point."""
        i, n = 0, len(tokens)
        while i < n:
            if off < len(node):
                c = 0
                if node.prov == prov and node.version == version:
                    c = _common_prefix(node.tokens[off:], tokens[i:])
                if c:
                    off += c
                    i += c
                    continue
                node = self._split(node, off)
                off = len(node)
            child = node.children.get((int(tokens[i]), prov, version))
            if child is None:
                node = self._new_node(
                    node, tokens[i:], prov, version, None if lp is None else lp[i:]
                )
                return node, len(node)
            node, off = child, 0
        return node, off

    # ---- queries ------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._end)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._end

    def context_len(self, request_id: str) -> int:
        """Tokens in the call's input + output."""
        return self._end_depth[request_id]

    def end_node(self, request_id: str) -> Node:
        """The node at whose end the call's output ends (where its scores attach)."""
        return self._end[request_id]

    def path_tokens(self, request_id: str) -> np.ndarray:
        """The call's full input + output (walks up the tree; for checks and tools)."""
        return np.concatenate(
            [n.tokens for n in reversed(self._path(self._end[request_id]))]
            or [np.zeros(0, np.int32)]
        )

    def path_provenance(self, request_id: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(provenance codes, versions, logprobs) along the call's path, shape (L,) each."""
        nodes = list(reversed(self._path(self._end[request_id])))
        if not nodes:
            z = np.zeros(0)
            return z.astype(np.int8), z.astype(np.int64), z.astype(np.float32)
        prov = np.concatenate([np.full(len(n), n.prov, np.int8) for n in nodes])
        ver = np.concatenate([np.full(len(n), n.version, np.int64) for n in nodes])
        lp = np.concatenate(
            [
                n.logprobs if n.logprobs is not None else np.full(len(n), np.nan, np.float32)
                for n in nodes
            ]
        )
        return prov, ver, lp

    def _path(self, node: Node) -> list[Node]:
        out = []
        while node is not self.root:
            out.append(node)
            node = node.parent  # type: ignore[assignment]
        return out

    def nodes(self) -> list[Node]:
        """All nodes in DFS preorder (children in insertion order); the root excluded."""
        out: list[Node] = []
        stack = list(reversed(self.root.children.values()))
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(reversed(n.children.values()))
        return out

    def leaves(self) -> list[str]:
        """One request id per leaf path: calls whose context no other call extends.

        Calls with exactly the same path (duplicates) share an end node; the first
        one added stands for all of them."""
        return [n.ends[0] for n in self.nodes() if not n.children and n.ends]

    def flatten(self) -> FlatTree:
        """Token-level DFS-preorder layout of the whole tree (tasks/tree_layout.py)."""
        return flatten(self)

    def end_nodes(self) -> dict[str, Node]:
        """Request id -> the node its context ends in (a copy)."""
        return dict(self._end)

    def node_rows(
        self, run_id: str | None = None, scores_at: Mapping[str, float] | None = None
    ) -> list[dict[str, Any]]:
        """Rows of the ``nodes`` dataset (storage/schemas.py: NODES_SCHEMA).

        ``node_id`` is the node's DFS-preorder index in this snapshot (parents have
        smaller ids); ``scores_at`` maps a request id to the score earned at the end
        of that call (see ``tasks.trajectory.scoring.scores_at_requests``)."""
        nodes = self.nodes()
        pre = {n.id: i for i, n in enumerate(nodes)}
        through: list[list[str]] = [[] for _ in nodes]
        score: list[float | None] = [None] * len(nodes)
        for rid, end in self._end.items():
            for n in self._path(end):
                through[pre[n.id]].append(rid)
        if scores_at:
            for rid, s in scores_at.items():
                if rid in self._end:
                    i = pre[self._end[rid].id]
                    score[i] = (score[i] or 0.0) + float(s)
        rows = []
        depth: dict[int, int] = {}
        for i, n in enumerate(nodes):
            parent = -1 if n.parent is self.root else pre[n.parent.id]  # type: ignore[union-attr]
            depth[i] = 1 if parent < 0 else depth[parent] + 1
            rows.append(
                {
                    "run_id": self.run_id if run_id is None else run_id,
                    "session_id": self.session_id,
                    "node_id": i,
                    "parent_id": parent,
                    "start": n.start,
                    "length": len(n),
                    "depth": depth[i],
                    "provenance": PROVENANCES[n.prov],
                    "policy_version": n.version if n.prov == POLICY else -1,
                    "request_ids": through[i],  # arrival order
                    "n_children": len(n.children),
                    "score": score[i],
                }
            )
        return rows


def _input_segments(n: int, spans: Sequence[Span] | None, rid: str) -> list[tuple[int, int, int]]:
    """Split ``range(n)`` into (lo, hi, provenance code) runs; uncovered parts are harness."""
    if not spans:
        return [(0, n, HARNESS)] if n else []
    out: list[tuple[int, int, int]] = []
    pos = 0
    for lo, hi, name in sorted(spans):
        if name not in _PROV_CODE or name == "policy":
            raise TreeError(
                f"record {rid!r}: span provenance {name!r} must be one of harness, tool, env"
            )
        if lo < pos or hi > n or lo > hi:
            raise TreeError(
                f"record {rid!r}: span ({lo}, {hi}) overlaps or lies outside new input [0, {n})"
            )
        if lo > pos:
            out.append((pos, lo, HARNESS))
        if hi > lo:
            out.append((lo, hi, _PROV_CODE[name]))
        pos = hi
    if pos < n:
        out.append((pos, n, HARNESS))
    return out


def build_trees(
    records: Iterable[TitoRecord],
    *,
    session_parents: Mapping[str, str | tuple[str, str | None]] | None = None,
    spans: Mapping[str, Sequence[Span]] | None = None,
) -> dict[str, TrajectoryTree]:
    """One tree per session, records placed in (session, seq_no) order.

    ``session_parents`` maps a sub-agent session to the session that spawned it
    (optionally ``(session, request_id)`` naming the spawning call); a record's
    ``extra['parent_session_id']`` is used when the mapping does not name it.
    """
    by_session: dict[str, list[TitoRecord]] = {}
    for r in records:
        by_session.setdefault(r.session_id, []).append(r)
    trees: dict[str, TrajectoryTree] = {}
    for sid, recs in by_session.items():
        recs.sort(key=lambda r: r.seq_no)
        link = (session_parents or {}).get(sid)
        if link is None:
            link = next(
                (
                    r.extra.get("parent_session_id")
                    for r in recs
                    if r.extra and r.extra.get("parent_session_id")
                ),
                None,
            )
        psid, prid = (link, None) if link is None or isinstance(link, str) else link
        tree = TrajectoryTree(
            sid, run_id=recs[0].run_id, parent_session_id=psid, parent_request_id=prid
        )
        tree.extend(recs, spans)
        trees[sid] = tree
    return trees


def root_session(parents: Mapping[str, str | None], session_id: str) -> str:
    """The top-level session a (possibly nested) sub-agent session works for.

    ``parents`` maps a session id to the session it works for (None or absent at the
    top); ``session_parents(trees)`` builds it from trees. A cycle is corrupt input.
    """
    seen = {session_id}
    sid = session_id
    while True:
        parent = parents.get(sid)
        if parent is None:
            return sid
        sid = parent
        if sid in seen:
            raise TreeError(f"session parents form a cycle through {sid!r}")
        seen.add(sid)


def session_parents(trees: Mapping[str, TrajectoryTree]) -> dict[str, str | None]:
    """session id -> the session it works for, from the trees' sub-agent links."""
    return {sid: t.parent_session_id for sid, t in trees.items()}
