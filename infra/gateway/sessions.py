"""Gateway sessions: one API key per rollout, the session's calls, its cell.

A key names exactly one session; a harness holding it can read and write only that session.
Sessions are journaled (``sessions.jsonl`` in the gateway's spool directory, fsynced) so that a
gateway restarted on the same spool directory still accepts the keys it handed out.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infra.gateway.call_index import ChatInput, SessionCalls
from infra.gateway.ids_json import IdsJsonCache
from storage.tito import TitoRecord, reconstruct_inputs

log = logging.getLogger(__name__)
_LINE_START = '{"session_id": '  # how every journal line begins (json.dumps of a dict)


@dataclass(eq=False)
class Session:
    session_id: str
    key: str
    group_id: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    calls: SessionCalls = field(default_factory=SessionCalls)
    seq: int = 0  # next seq_no
    cell_id: str | None = None
    last_request_id: str | None = None  # latest finished call (its context is the KV to move)
    inflight: int = 0
    # call rid -> (cell id, engine rid) whose engine-held context starts with the call's
    # context: the prefix handle of the next call on that cell (infra/gateway/pipeline.py)
    engine_rids: dict[str, tuple[str, str]] = field(default_factory=dict)
    unrecorded: int = 0  # calls generated whose TITO record is not written yet
    # the last call's input ids as JSON, for engines that take the whole input every call
    ids_json: IdsJsonCache = field(default_factory=IdsJsonCache)
    tokens: int = 0  # unique tokens so far (new input + output of every call)
    # Responses API: response id -> (previous response id, messages it added, the response
    # object); rebuilt from the TITO records after a restart (infra/gateway/responses.py)
    responses: dict[str, tuple[str | None, list[dict], dict]] = field(default_factory=dict)
    # guards `calls` when a large session's input is built on a worker thread
    state_lock: threading.Lock = field(default_factory=threading.Lock)
    _lock: asyncio.Lock | None = None

    def next_seq(self) -> int:
        s = self.seq
        self.seq += 1
        return s

    @property
    def lock(self) -> asyncio.Lock:
        """Serialises cell moves of this session (created on the event loop)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock


class SessionTable:
    """Sessions by id and by key; thread-safe creation, journaled when given a path."""

    def __init__(self, journal: str | None = None):
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._journal = journal
        if journal and os.path.exists(journal):
            with open(journal, encoding="utf-8", errors="replace") as fh:
                for n, line in enumerate(fh, 1):
                    d = _journal_entry(line)
                    if d is None:
                        if line.strip():
                            log.warning(
                                "session journal %s: line %d is torn (a full disk or a crash "
                                "mid-write): skipped, its session was never handed out",
                                journal,
                                n,
                            )
                        continue
                    self._put(
                        Session(
                            d["session_id"], d["key"], d.get("group_id", ""), d.get("meta") or {}
                        )
                    )

    def _put(self, s: Session) -> None:
        self._by_id[s.session_id] = s
        self._by_key[s.key] = s

    def new(
        self, session_id: str | None = None, *, group_id: str = "", meta: dict | None = None
    ) -> Session:
        sid = session_id or f"sess-{uuid.uuid4().hex}"
        if not isinstance(sid, str) or not sid or len(sid) > 200:
            raise ValueError("session_id must be a non-empty string of at most 200 characters")
        with self._lock:
            if sid in self._by_id:
                raise ValueError(f"session {sid!r} already exists")
            s = Session(sid, f"gyre-{secrets.token_urlsafe(24)}", group_id, dict(meta or {}))
            if self._journal:
                line = json.dumps(
                    {"session_id": sid, "key": s.key, "group_id": group_id, "meta": s.meta}
                )
                append_line(self._journal, line.encode())
            self._put(s)
        return s

    def by_key(self, key: str) -> Session | None:
        s = self._by_key.get(key)
        # constant-time compare of the stored key (the dict lookup already matched)
        if s is not None and hmac.compare_digest(s.key, key):
            return s
        return None

    def get(self, session_id: str) -> Session | None:
        return self._by_id.get(session_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def all(self) -> list[Session]:
        return list(self._by_id.values())


def _journal_entry(line: str) -> dict | None:
    """One journal line's session, or None for a torn line. A whole line glued after a torn
    one (written by gyre before torn lines were ended) is still read."""
    for start in (0, line.rfind(_LINE_START)):
        if start < 0:
            continue
        try:
            d = json.loads(line[start:])
        except ValueError:
            continue
        if isinstance(d, dict) and isinstance(d.get("session_id"), str) and "key" in d:
            return d
    return None


def append_line(path: str, data: bytes) -> None:
    """Append ``data`` as one line, fsynced, to a journal readable by this user only (it holds
    API keys). If the file does not end in a newline (its last write was torn by a full disk
    or a crash), a new line is started first, so this one is never glued to the torn one."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        view = memoryview(data + b"\n")
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def end_torn_line(path: str) -> None:
    """End a journal's torn last line (if any), before appending to it through a plain file."""
    try:
        with open(path, "rb+") as fh:
            if fh.seek(0, os.SEEK_END) == 0:
                return
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                fh.write(b"\n")
    except FileNotFoundError:
        pass


# -- restart: rebuilding a session's call index --------------------------------------------


def read_key_journal(path: str) -> dict[str, dict[str, tuple[bytes, bytes]]]:
    """session -> request -> (messages key, reply digest), from the gateway's key journal
    (lines ``session request msgkey-hex replydigest-hex``; a torn last line is skipped)."""
    out: dict[str, dict[str, tuple[bytes, bytes]]] = {}
    try:
        with open(path, "rb") as fh:
            for line in fh:
                parts = line.rstrip(b"\n").split(b" ")
                if len(parts) != 4:
                    continue
                try:
                    keys = (bytes.fromhex(parts[2].decode()), bytes.fromhex(parts[3].decode()))
                except ValueError:
                    continue
                out.setdefault(parts[0].decode(), {})[parts[1].decode()] = keys
    except OSError:
        pass
    return out


def restore_calls(
    s: Session, records: list[TitoRecord], keys: dict[str, tuple[bytes, bytes]], im_end_id: int
) -> None:
    """Refill ``s.calls`` from the session's TITO records (and message keys, so that the next
    chat turn extends the last call exactly as before the restart)."""
    if not records:
        return
    full = reconstruct_inputs(records)
    for r in sorted(records, key=lambda r: r.seq_no):
        mk, rk = keys.get(r.request_id, (None, None))
        inp = ChatInput(
            full[r.request_id], r.parent_request_id, r.prefix_len, "restored", msg_key=mk
        )
        out = np.asarray(r.output_ids, dtype=np.int32)
        s.calls.add(r.request_id, r.seq_no, inp, out, reply_digest=rk, im_end_id=im_end_id)
        s.last_request_id = r.request_id
    s.seq = max(s.seq, max(r.seq_no for r in records) + 1)
    s.tokens = sum(len(r.new_input_ids) + len(r.output_ids) for r in records)
