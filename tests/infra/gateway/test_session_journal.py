"""The session-key journal survives a torn line (a full cache disk, a crash mid-write): the
next session's line is not glued to it, and after a restart every handed-out key works."""

from __future__ import annotations

import logging

import httpx
import pytest

from infra.engine.tiny_model import make_tiny_model
from infra.gateway.gateway import Gateway
from infra.gateway.sessions import SessionTable
from storage.store import Store

TORN = '{"session_id": "sess-torn", "key": "gyre-abc'  # the write that hit a full disk


def test_a_torn_line_loses_no_later_session(tmp_path, caplog):
    journal = str(tmp_path / "sessions.jsonl")
    table = SessionTable(journal)
    a = table.new(group_id="g0")
    with open(journal, "a", encoding="utf-8") as fh:
        fh.write(TORN)  # no newline: the disk filled mid-line, new() raised
    b = table.new(group_id="g1")  # space again: the next session
    with caplog.at_level(logging.WARNING):
        restored = SessionTable(journal)  # a restart
    assert restored.by_key(a.key) is restored.get(a.session_id)
    assert restored.by_key(b.key) is not None and restored.get(b.session_id).group_id == "g1"
    assert restored.get("sess-torn") is None and len(restored) == 2
    assert "torn" in caplog.text
    c = restored.new()  # appends after a restart land on their own line too
    assert SessionTable(journal).by_key(c.key) is not None


def test_a_line_glued_by_an_older_gyre_is_still_read(tmp_path):
    journal = tmp_path / "sessions.jsonl"
    journal.write_text(
        TORN + '{"session_id": "sess-b", "key": "gyre-b", "group_id": "g", "meta": {}}\n'
        '{"session_id": "sess-c", "key": "gyre-c", "group_id": "g", "meta": {}}\n'
    )
    restored = SessionTable(str(journal))
    assert restored.by_key("gyre-b") is not None and restored.by_key("gyre-c") is not None


@pytest.fixture(scope="module")
def model_dir():
    return make_tiny_model()


def test_after_a_torn_journal_and_a_restart_the_later_key_is_accepted(tmp_path, model_dir):
    store, spool = Store(str(tmp_path / "store")), str(tmp_path / "spool")

    def start() -> Gateway:
        gw = Gateway(store, run_id="torn", tokenizer_dir=model_dir, spool_dir=spool)
        gw.start()
        return gw

    def status(gw: Gateway, key: str) -> int:
        return httpx.get(
            gw.openai_base_url + "/models", headers={"Authorization": f"Bearer {key}"}
        ).status_code

    gw = start()
    _, key_a = gw.new_session()
    with open(f"{spool}/sessions.jsonl", "a", encoding="utf-8") as fh:
        fh.write(TORN)
    _, key_b = gw.new_session()
    assert status(gw, key_b) == 200
    gw.stop()
    gw = start()
    try:
        assert status(gw, key_a) == 200 and status(gw, key_b) == 200
        assert status(gw, "gyre-abc") == 401
    finally:
        gw.stop()


def test_the_chat_key_journal_ends_a_torn_line_before_appending(tmp_path):
    from infra.gateway.sessions import end_torn_line, read_key_journal

    path = str(tmp_path / "chatkeys.bin")
    end_torn_line(path)  # no file yet: nothing to do
    with open(path, "wb") as fh:
        fh.write(b"s1 r1 00ff 11\ns1 r2 ab")  # a crash mid-line
    end_torn_line(path)  # what a gateway does before it opens the journal for appending
    with open(path, "ab") as fh:
        fh.write(b"s1 r3 cd ef\n")
    keys = read_key_journal(path)["s1"]
    assert set(keys) == {"r1", "r3"} and keys["r3"] == (b"\xcd", b"\xef")
