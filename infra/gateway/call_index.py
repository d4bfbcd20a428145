"""Per-session index of earlier calls: delta-encoded contexts, longest-prefix parent lookup.

Every call of a session is kept as its TITO record is (``prefix_len`` shared with a parent +
the tokens it adds), so memory is O(unique tokens). The session's main line (each call
extending the whole context of the one before, as an agent's turns do) is one append-only
int32 buffer, the *spine*: its calls' tokens and contexts are slices of it, so a linear
session of n tokens holds ~4n bytes of ids, not a copy per call or per cached context. Contexts (input + output) are indexed by
chained hashes of fixed-size chunks (``CHUNK`` tokens): a lookup hashes the new input once
(reusing the hint parent's hashes for the part they share), binary-searches the deepest chunk
some earlier call shares, then compares at most one chunk per candidate. Recording a call
registers only the chunks past its parent's shared prefix, so it costs O(new tokens) whatever
the context length (~1M tokens) and the number of calls (hundreds).

Pure module: numpy and hashlib only.
"""

from __future__ import annotations

import hashlib
import sys
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from storage.tito import common_prefix_len

CHUNK = 256  # tokens per hashed chunk of the context index
_H = 8  # digest bytes


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass(slots=True)
class CallState:
    request_id: str
    seq_no: int
    parent: str | None
    prefix_len: int
    own: np.ndarray | None  # new_input_ids + output_ids (int32); None: on the spine
    input_len: int
    output_len: int
    ended_im_end: bool
    hashes: bytes | None  # chained digests of the context's full chunks; None: the spine's
    head: np.ndarray  # first CHUNK tokens of the context
    on_spine: bool = False  # context == the spine's first context_len tokens

    @property
    def context_len(self) -> int:
        return self.input_len + self.output_len


@dataclass
class ChatInput:
    """What a call sends: full input ids, and its delta encoding against the chosen parent."""

    input_ids: np.ndarray
    parent_request_id: str | None
    prefix_len: int
    mode: str  # extend | branch | tokens
    msg_key: bytes | None = None
    hashes: bytes = b""
    info: dict = field(default_factory=dict)
    # chat: the earlier call whose messages and reply this call's messages start with, and
    # where its reply sits in them (messages[:after_at] were that call's messages)
    after: str | None = None
    after_at: int = 0

    @property
    def new_input_ids(self) -> np.ndarray:
        return self.input_ids[self.prefix_len :]


def chunk_hashes(ids: np.ndarray, start_chunk: int = 0, prev: bytes = b"") -> bytes:
    """Chained digests of ids' full CHUNK-token chunks from ``start_chunk`` (prev = digests before)."""
    out = [prev]
    h = prev[-_H:] if prev else b"root"
    n_full = len(ids) // CHUNK
    for j in range(start_chunk, n_full):
        h = hashlib.blake2b(h + ids[j * CHUNK : (j + 1) * CHUNK].tobytes(), digest_size=_H).digest()
        out.append(h)
    return b"".join(out)


class ChainMemo:
    """The last chat call's messages and chain keys of one session, so that a call that
    re-sends the whole conversation hashes only its new messages (O(new), not O(context)).

    ``state`` = (tools, messages, keys), set as one tuple (calls may build in threads);
    keys[k] names messages[:k]. infra/gateway/chat.py: message_chain reuses a key only while
    the message is strictly equal to the memoised one (``same_json``)."""

    def __init__(self) -> None:
        self.state: tuple[list, list[dict], list[bytes]] | None = None


class SessionCalls:
    """Every earlier call of one session, delta-encoded, with prefix and message indexes."""

    def __init__(self, ctx_cache: int = 2):
        self.calls: dict[str, CallState] = {}
        self._by_chunk: dict[bytes, list[str]] = {}
        self._by_reply: dict[tuple[bytes, bytes], str] = {}
        self._ctx: OrderedDict[str, np.ndarray] = OrderedDict()
        self._ctx_cap = ctx_cache
        self._heads = np.full((0, CHUNK), -1, dtype=np.int32)  # first CHUNK tokens per call
        self._head_rids: list[str] = []
        self._spine = np.zeros(0, dtype=np.int32)  # append-only; [:_spine_n] is held
        self._spine_n = 0
        self._spine_rid: str | None = None  # the call whose context is the whole spine
        self._spine_hashes = bytearray()  # chunk digests of the spine's full chunks
        self._held = 0  # bytes of ids, digests and lookups the calls added (held_bytes)
        # the one input being built on the spine past its end (`extend_on_spine`), while alive
        self._lent: weakref.ref | None = None
        # the chat chain keys of the last call's messages (infra/gateway/chat.py: message_chain)
        self.chain_memo = ChainMemo()
        # the last chat body, for parsing only what the next one adds (infra/gateway/chat_body.py)
        self.body_memo = None

    def __len__(self) -> int:
        return len(self.calls)

    # -- contexts --------------------------------------------------------------------------
    def context(self, rid: str) -> np.ndarray:
        """Full input + output of an earlier call (int32), rebuilt from deltas if not cached
        (a call on the spine: a view of it, no copy)."""
        c = self.calls[rid]
        if c.on_spine:
            return self._spine[: c.context_len]
        got = self._ctx.get(rid)
        if got is not None:
            self._ctx.move_to_end(rid)
            return got
        parts: list[np.ndarray] = []
        cur: str | None = rid
        need = self.calls[rid].context_len
        while cur is not None:
            c = self.calls[cur]
            cached = self._spine if c.on_spine else self._ctx.get(cur)
            if cached is not None:
                parts.append(cached[:need])
                break
            parts.append(c.own[: max(0, need - c.prefix_len)])
            need = min(need, c.prefix_len)
            cur = c.parent if need > 0 else None
        ctx = np.concatenate(parts[::-1]) if len(parts) > 1 else parts[0]
        self._remember(rid, ctx)
        return ctx

    def _remember(self, rid: str, ctx: np.ndarray) -> None:
        self._ctx[rid] = ctx
        self._ctx.move_to_end(rid)
        while len(self._ctx) > self._ctx_cap:
            self._ctx.popitem(last=False)

    def _slice(self, rid: str, a: int, b: int) -> np.ndarray:
        """context(rid)[a:b] without rebuilding the whole context."""
        c = self.calls[rid]
        b = min(b, c.context_len)
        got = self._spine if c.on_spine else self._ctx.get(rid)
        if got is not None:
            return got[a:b]
        if b <= a:
            return np.zeros(0, dtype=np.int32)
        if b <= CHUNK:
            return c.head[a:b]
        if a >= c.prefix_len:
            return c.own[a - c.prefix_len : b - c.prefix_len]
        left = self._slice(c.parent, a, min(b, c.prefix_len)) if c.parent else np.zeros(0, np.int32)
        if b <= c.prefix_len:
            return left
        return np.concatenate([left, c.own[: b - c.prefix_len]])

    # -- lookups ---------------------------------------------------------------------------
    def by_reply(self, msg_key: bytes, reply_digest: bytes) -> str | None:
        """The call that answered messages named ``msg_key`` with this reply, if any."""
        return self._by_reply.get((msg_key, reply_digest))

    def find_parent(
        self, ids: np.ndarray, *, hint: str | None = None
    ) -> tuple[str | None, int, bytes]:
        """(parent rid, shared prefix length, ids' chunk hashes): longest prefix over all calls."""
        if hint is not None and hint in self.calls:
            c = self.calls[hint]
            prev = self._hashes(c, min(c.context_len // CHUNK, len(ids) // CHUNK))
            hashes = chunk_hashes(ids, len(prev) // _H, prev)
        else:
            hashes = chunk_hashes(ids)
        if not self.calls:
            return None, 0, hashes
        n = len(hashes) // _H
        lo, hi = 0, n  # largest j with hashes[j-1] known (monotone: a prefix of a prefix)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[(mid - 1) * _H : mid * _H] in self._by_chunk:
                lo = mid
            else:
                hi = mid - 1
        j = lo
        base = j * CHUNK
        want = ids[base : base + CHUNK]
        if j == 0:  # no full chunk shared: one vectorised compare against every call's head
            heads = self._heads[: len(self._head_rids), : len(want)]
            eq = heads == want
            k_rows = np.where(eq.all(axis=1), len(want), eq.argmin(axis=1))
            best_k = int(k_rows.max()) if len(k_rows) else 0
            if best_k == 0:
                return None, 0, hashes
            return self._head_rids[int(np.flatnonzero(k_rows == best_k)[-1])], best_k, hashes
        cands = self._by_chunk[hashes[(j - 1) * _H : j * _H]]
        best, best_k, best_seq = None, -1, -1
        for rid in cands:
            k = base + common_prefix_len(want, self._slice(rid, base, base + CHUNK))
            seq = self.calls[rid].seq_no
            if k > best_k or (k == best_k and seq > best_seq):
                best, best_k, best_seq = rid, k, seq
        if best is None or best_k == 0:
            return None, 0, hashes
        return best, best_k, hashes

    # -- recording -------------------------------------------------------------------------
    def add(
        self,
        request_id: str,
        seq_no: int,
        inp: ChatInput,
        output_ids: np.ndarray,
        *,
        reply: bytes | None = None,
        im_end_id: int | None = None,
        reply_digest: bytes | None = None,
    ) -> CallState:
        """Remember a finished call (after its TITO record is durable).

        ``reply`` is ``reply_key(...)`` of what the gateway answered (or pass its
        ``digest`` as ``reply_digest``, e.g. when restoring from a journal)."""
        ids = inp.input_ids
        out = np.asarray(output_ids, dtype=np.int32)
        n_in = len(ids)
        m = len(inp.hashes) // _H
        if m * CHUNK != n_in - n_in % CHUNK or m == 0:
            hashes_in = chunk_hashes(ids)
            m = len(hashes_in) // _H
        else:
            hashes_in = inp.hashes
        tail = np.concatenate([ids[m * CHUNK :], out])
        extra = chunk_hashes(tail, 0, hashes_in[-_H:] if m else b"")
        hashes = hashes_in + extra[_H if m else 0 :]
        ctx_head = np.concatenate([ids[:CHUNK], out[: max(0, CHUNK - n_in)]])
        own = np.concatenate([ids[inp.prefix_len :], out]).astype(np.int32, copy=False)
        # on the spine: the first call, or one that extends the spine's whole context
        lent = self._lent() if self._lent is not None else None
        mine = lent is not None and lent is ids  # this call's input lies past the spine's end
        on_spine = (lent is None or mine) and (
            (inp.parent_request_id is None and inp.prefix_len == 0 and self._spine_rid is None)
            or (
                inp.parent_request_id is not None
                and inp.parent_request_id == self._spine_rid
                and inp.prefix_len == self._spine_n
            )
        )
        if mine:
            self._lent = None
        if on_spine:  # its context extends the spine's, so do its chunk digests
            self._grow_spine(own)
            self._spine_hashes += memoryview(hashes)[len(self._spine_hashes) :]
            self._spine_rid = request_id
        c = CallState(
            request_id=request_id,
            seq_no=seq_no,
            parent=inp.parent_request_id,
            prefix_len=inp.prefix_len,
            own=None if on_spine else own,
            input_len=n_in,
            output_len=len(out),
            ended_im_end=bool(len(out) and im_end_id is not None and int(out[-1]) == im_end_id),
            hashes=None if on_spine else hashes,
            head=ctx_head,
            on_spine=on_spine,
        )
        self.calls[request_id] = c
        n = len(self._head_rids)
        if n == len(self._heads):
            grown = np.full((max(16, 2 * n), CHUNK), -1, dtype=np.int32)
            grown[:n] = self._heads
            self._heads = grown
        self._heads[n, : len(ctx_head)] = ctx_head
        self._head_rids.append(request_id)
        # Chunks fully inside the parent's shared prefix (and the one after) are already
        # represented by an ancestor with the same tokens there: register only the rest, so
        # that recording a call costs O(new tokens), not O(context).
        first = max(0, inp.prefix_len // CHUNK - 1) if inp.parent_request_id else 0
        held = c.head.nbytes + (own.nbytes + len(hashes) if not on_spine else 4 * len(own))
        for j in range(first, len(hashes) // _H):
            key = hashes[j * _H : (j + 1) * _H]
            got = self._by_chunk.get(key)
            if got is None:
                got = self._by_chunk[key] = []
                held += sys.getsizeof(key) + sys.getsizeof(got)
            got.append(request_id)
            held += 8  # the list's slot
        self._held += held
        if reply is not None:
            reply_digest = digest(reply)
        if inp.msg_key is not None and reply_digest is not None:
            self._by_reply[(inp.msg_key, reply_digest)] = request_id
        if not on_spine:
            self._remember(request_id, np.concatenate([ids, out]))
        return c

    def extend_on_spine(self, rid: str, suffix: np.ndarray) -> np.ndarray:
        """``context(rid)`` + ``suffix`` as one array: when ``rid``'s context is the whole
        spine, the suffix is written past the spine's end and the input is a view of it (no
        copy of the context; the call's record then appends in place). One such input at a
        time: while it is alive (a weak reference), others are copies, and `add` keeps any
        other call off the spine, so nothing writes under it."""
        c = self.calls[rid]
        free = self._lent is None or self._lent() is None
        if not (free and c.on_spine and rid == self._spine_rid):
            return np.concatenate([self.context(rid), suffix])
        n, k = self._spine_n, len(suffix)
        self._reserve(n + k)
        self._spine[n : n + k] = suffix
        view = self._spine[: n + k]
        self._lent = weakref.ref(view)
        return view

    def _reserve(self, need: int) -> None:
        if need > len(self._spine):
            grown = np.empty(max(2 * len(self._spine), need, 4096), dtype=np.int32)
            grown[: self._spine_n] = self._spine[: self._spine_n]
            self._spine = grown

    def _grow_spine(self, tokens: np.ndarray) -> None:
        """Append to the spine (capacity doubling; what is held never moves within a buffer,
        so earlier views of it stay exact)."""
        n, k = self._spine_n, len(tokens)
        self._reserve(n + k)
        self._spine[n : n + k] = tokens
        self._spine_n = n + k

    def held_bytes(self) -> int:
        """Bytes this index holds for the session (ids, digests, lookups, the last chat
        body): what grows with its tokens, Python object headers of the lookups included."""
        n = self._held + len(self._spine_hashes) + self._heads.nbytes  # _held: kept by add
        n += sum(a.nbytes for a in self._ctx.values()) + sys.getsizeof(self._by_chunk)
        memo = self.body_memo
        return n + (memo.end if memo is not None else 0)

    def _hashes(self, c: CallState, m: int) -> bytes:
        """The first ``m`` chunk digests of call ``c``'s context."""
        if c.hashes is not None:
            return c.hashes[: m * _H]
        return bytes(self._spine_hashes[: min(m, c.context_len // CHUNK) * _H])
