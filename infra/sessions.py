"""Gateway sessions: one API key per rollout, the session's calls, its cell.

A key names exactly one session; a harness holding it can read and write only that session.
Sessions are journaled (``sessions.jsonl`` in the gateway's spool directory, fsynced) so that a
gateway restarted on the same spool directory still accepts the keys it handed out.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import secrets
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from infra.chat import SessionCalls


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
    tokens: int = 0  # unique tokens so far (new input + output of every call)
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
            with open(journal, encoding="utf-8") as fh:
                for line in fh:
                    try:
                        d = json.loads(line)
                    except ValueError:  # a torn last line: that session was never handed out
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
                with open(self._journal, "a", encoding="utf-8") as fh:
                    fh.write(line + "\n")
                    fh.flush()
                    os.fsync(fh.fileno())
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
