import numpy as np
import pytest

from storage.tito import (
    ReconstructionError,
    TitoRecord,
    common_prefix_len,
    delta_encode,
    reconstruct_inputs,
    unique_tokens,
)


def rec(rid, parent, prefix_len, new, out, seq=0):
    return TitoRecord("r", "s", rid, seq, parent, prefix_len, new, out, [0.0] * len(out), 0)


def test_common_prefix_and_delta():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert delta_encode([1, 2, 3, 9], [1, 2, 3, 4, 5]) == (3, [9])
    assert delta_encode([5, 6], None) == (0, [5, 6])


def test_reconstruct_chain_branch_and_reset():
    a = rec("a", None, 0, [1, 2, 3], [4, 5])
    b = rec("b", "a", 5, [6], [7])  # extends a's input + output
    c = rec("c", "a", 3, [8], [9])  # rollback: branch after a's input
    d = rec("d", "a", 1, [10, 11], [12])  # context reset: shares only the system token
    full = reconstruct_inputs([d, c, b, a])  # any order
    assert full["a"].tolist() == [1, 2, 3]
    assert full["b"].tolist() == [1, 2, 3, 4, 5, 6]
    assert full["c"].tolist() == [1, 2, 3, 8]
    assert full["d"].tolist() == [1, 10, 11]
    assert unique_tokens([a, b, c, d]) == 5 + 2 + 2 + 3


def test_reconstruct_errors():
    with pytest.raises(ReconstructionError, match="missing parent"):
        reconstruct_inputs([rec("b", "zzz", 1, [1], [2])])
    with pytest.raises(ReconstructionError, match="prefix_len"):
        reconstruct_inputs([rec("a", None, 0, [1], [2]), rec("b", "a", 5, [3], [4])])


def test_row_roundtrip():
    r = rec("a", None, 0, np.array([1, 2], dtype=np.int32), [3])
    row = r.to_row()
    assert row["new_input_ids"] == [1, 2] and "extra" not in row
    assert TitoRecord.from_row(row) == TitoRecord.from_row({**row, "unknown": 1})


def test_whole_requests_rebuild_chat_messages_along_after():
    """A chat call stores the messages it added since the call it extends (``after``); its
    whole request is the chain's messages joined, with its own tools."""
    import json
    from dataclasses import replace

    from storage.tito import whole_requests

    def req(r, **d):
        return replace(r, request_json=json.dumps(d))

    u = lambda text: {"role": "user", "content": text}  # noqa: E731
    a = req(rec("a", None, 0, [1], [2]), messages=[u("1")])
    b = req(rec("b", "a", 2, [3], [4]), after="a", messages=[u("2")], tools=[{"t": 1}])
    c = req(rec("c", "a", 2, [5], [6]), after="a", messages=[u("3")])  # a branch of a
    d = req(rec("d", None, 0, [7], [8]), messages=[u("4")])  # a reset: all its messages
    e = rec("e", "d", 2, [9], [10])  # no request_json (completions, or an old segment)
    f = req(rec("f", "e", 3, [], [11]), after="e", messages=[u("5")])  # its chain is broken
    g = req(rec("g", None, 0, [1], [2]), input="hi", previous_response_id="x")  # responses
    got = whole_requests([g, f, e, d, c, b, a], ["b", "c", "d", "e", "f", "g", "a"])
    assert {k: v and json.loads(v) for k, v in got.items()} == {
        "a": {"messages": [u("1")]},
        "b": {"messages": [u("1"), u("2")], "tools": [{"t": 1}]},
        "c": {"messages": [u("1"), u("3")]},
        "d": {"messages": [u("4")]},
        "e": None,
        "f": None,
        "g": {"input": "hi", "previous_response_id": "x"},
    }
