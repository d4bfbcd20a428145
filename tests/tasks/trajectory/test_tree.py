"""Trajectory trees: hand-built cases and tree paths vs reconstruct_inputs."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from storage.schemas import NODES_SCHEMA
from storage.tito import TitoRecord, reconstruct_inputs
from tasks.trajectory.synth import long_rollout, random_session, reference_paths
from tasks.trajectory.tree import (
    HARNESS,
    POLICY,
    TOOL,
    TrajectoryTree,
    TreeError,
    build_trees,
    root_session,
    session_parents,
)


def rec(rid, parent, k, new, out, v=0, seq=0, session="s"):
    lp = [-0.5] * len(out)
    return TitoRecord("run", session, rid, seq, parent, k, new, out, lp, v)


def test_linear_chain_is_one_segment_per_provenance():
    t = TrajectoryTree("s")
    t.add(rec("a", None, 0, [1, 2, 3], [4, 5]))
    t.add(rec("b", "a", 5, [6], [7, 8], seq=1))
    rows = t.node_rows("run")
    assert [(r["start"], r["length"], r["provenance"]) for r in rows] == [
        (0, 3, "harness"),
        (3, 2, "policy"),
        (5, 1, "harness"),
        (6, 2, "policy"),
    ]
    assert [r["parent_id"] for r in rows] == [-1, 0, 1, 2]
    assert [r["depth"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["request_ids"] == ["a", "b"]
    assert rows[3]["request_ids"] == ["b"]
    assert t.n_tokens == 8 and t.n_flat_tokens == 5 + 8
    assert t.leaves() == ["b"]


def test_retry_splits_segment_and_branches():
    t = TrajectoryTree("s")
    t.add(rec("a", None, 0, [1, 2, 3], [4, 5]))
    # retry from inside a's input: shares [1, 2], new input [9], output [7]
    t.add(rec("b", "a", 2, [9], [7], seq=1))
    rows = t.node_rows("run")
    segs = [(r["start"], r["length"], r["parent_id"], r["n_children"]) for r in rows]
    assert segs == [(0, 2, -1, 2), (2, 1, 0, 1), (3, 2, 1, 0), (2, 1, 0, 1), (3, 1, 3, 0)]
    assert sorted(t.leaves()) == ["a", "b"]
    assert t.path_tokens("a").tolist() == [1, 2, 3, 4, 5]
    assert t.path_tokens("b").tolist() == [1, 2, 9, 7]
    assert t.n_tokens == 5 + 2


def test_context_ending_inside_segment_is_cut_there():
    t = TrajectoryTree("s")
    t.add(rec("a", None, 0, [1, 2, 3], [4, 5]))
    t.add(rec("b", "a", 4, [], [], seq=1))  # context = [1, 2, 3, 4], no output
    assert t.end_node("b").start + len(t.end_node("b")) == 4
    assert t.path_tokens("b").tolist() == [1, 2, 3, 4]
    assert t.leaves() == ["a"]  # b is extended by a


def test_same_tokens_other_provenance_or_version_do_not_share_a_node():
    t = TrajectoryTree("s")
    t.add(rec("a", None, 0, [1, 2], [3, 4], v=0))
    t.add(rec("b", "a", 2, [], [3, 4], v=1, seq=1))  # same tokens, newer policy
    t.add(rec("c", "a", 2, [3, 4], [], seq=2))  # same tokens, as harness input
    prov, ver, _ = t.path_provenance("b")
    assert prov.tolist() == [HARNESS, HARNESS, POLICY, POLICY] and ver.tolist() == [-1, -1, 1, 1]
    prov, _, _ = t.path_provenance("c")
    assert prov.tolist() == [HARNESS] * 4
    assert len(t.node_rows()) == 4
    assert sorted(t.leaves()) == ["a", "b", "c"]


def test_a_newer_policy_regenerating_the_rest_of_an_output_is_its_own_branch():
    """Branching inside an output: the same continuation from a newer policy version is a
    new node (its version and logprobs are its own), not a walk along the old one."""
    t = TrajectoryTree("s")
    t.add(rec("a", None, 0, [1, 2], [3, 4, 5], v=0))
    t.add(TitoRecord("run", "s", "d", 1, "a", 3, [], [4, 5], [-0.5, -0.25], 1))
    _, ver, lp = t.path_provenance("d")
    assert ver.tolist() == [-1, -1, 0, 1, 1] and lp[3:].tolist() == [-0.5, -0.25]
    assert sorted(t.leaves()) == ["a", "d"]


def test_exact_duplicate_shares_the_path_and_counts_once():
    t = TrajectoryTree("s")
    t.add(rec("a", None, 0, [1, 2], [3, 4]))
    t.add(rec("a2", "a", 2, [], [3, 4], seq=1))  # identical call (same version)
    assert t.end_node("a") is t.end_node("a2")
    assert t.leaves() == ["a"]
    assert t.n_tokens == 4


def test_tool_spans_and_errors():
    t = TrajectoryTree("s")
    t.add(rec("a", None, 0, [1, 2, 3, 4], [5]), spans=[(1, 3, "tool")])
    prov, _, _ = t.path_provenance("a")
    assert prov.tolist() == [HARNESS, TOOL, TOOL, HARNESS, POLICY]
    with pytest.raises(TreeError, match="not in session"):
        t.add(rec("x", "missing", 1, [1], [2]))
    with pytest.raises(TreeError, match="prefix_len"):
        t.add(rec("y", "a", 99, [1], [2]))
    with pytest.raises(TreeError, match="belongs to session"):
        t.add(rec("z", None, 0, [1], [2], session="other"))
    with pytest.raises(TreeError, match="overlaps or lies outside"):
        t.add(rec("w", "a", 5, [1, 2], [3]), spans=[(1, 5, "env")])
    bad = TitoRecord("run", "s", "v", 1, "a", 5, [1, 2], [3, 4], [-1.0], 0)
    with pytest.raises(TreeError, match="1 output_logprobs for 2"):
        t.add(bad)
    assert t.n_tokens == 5 and len(t.nodes()) == 4 and "v" not in t  # nothing half-added


@pytest.mark.parametrize("seed", range(60))
def test_paths_match_reconstruct_inputs_and_reference_provenance(seed):
    rng = np.random.default_rng(seed)
    recs, spans = random_session(
        rng, n_calls=int(rng.integers(1, 25)), vocab=int(rng.choice([3, 8, 40]))
    )
    tree = TrajectoryTree("s0")
    built = []
    full = reconstruct_inputs(recs)
    ref = reference_paths(recs, spans)
    for r in recs:  # incremental: every earlier path stays right after each add
        tree.add(r, spans.get(r.request_id))
        built.append(r)
        for b in built[-3:]:
            expect = np.concatenate([full[b.request_id], np.asarray(b.output_ids, np.int32)])
            assert np.array_equal(tree.path_tokens(b.request_id), expect)
    for r in recs:
        prov, ver, lp = tree.path_provenance(r.request_id)
        tok, rprov, rver, rlp = ref[r.request_id]
        assert np.array_equal(tree.path_tokens(r.request_id), tok)
        assert np.array_equal(prov, rprov) and np.array_equal(ver, rver)
        assert np.array_equal(lp, rlp, equal_nan=True)
    # flat layout: walking parent_idx from a call's end reproduces its path
    ft = tree.flatten()
    assert ft.n_tokens == tree.n_tokens == int(sum(r["length"] for r in tree.node_rows()))
    assert np.all(ft.parent_idx < np.arange(ft.n_tokens))
    for r in recs:
        e = ft.ends[r.request_id]
        i = int(ft.node_offset[e] + ft.node_length[e]) - 1
        path = []
        while i >= 0:
            path.append(i)
            i = int(ft.parent_idx[i])
        path = path[::-1]
        assert np.array_equal(ft.token_ids[path], ref[r.request_id][0])
        assert np.array_equal(ft.positions[path], np.arange(len(path)))
    # compressed: no node with exactly one child unless a call ends there or provenance changes
    for n in tree.nodes():
        if len(n.children) == 1:
            (c,) = n.children.values()
            assert n.ends or (c.prov, c.version) != (n.prov, n.version)


def test_node_rows_match_schema_and_scores():
    recs, spans = random_session(np.random.default_rng(3), n_calls=10)
    tree = build_trees(recs, spans=spans)["s0"]
    rows = tree.node_rows("run", scores_at={recs[-1].request_id: 0.5, recs[-2].request_id: 0.25})
    table = pa.Table.from_pylist(rows, schema=NODES_SCHEMA)
    assert table.num_rows == len(rows)
    end = [r for r in rows if recs[-1].request_id in r["request_ids"] and r["n_children"] == 0]
    assert any(r["score"] is not None for r in rows)
    assert all(r["parent_id"] < r["node_id"] for r in rows)
    assert end


def test_build_trees_links_sub_agent_sessions():
    a, _ = random_session(np.random.default_rng(0), n_calls=4, session_id="main")
    b, _ = random_session(np.random.default_rng(1), n_calls=3, session_id="sub")
    c, _ = random_session(np.random.default_rng(2), n_calls=2, session_id="subsub")
    trees = build_trees(
        list(reversed(a + b + c)),
        session_parents={"sub": ("main", a[1].request_id), "subsub": "sub"},
    )
    assert (
        trees["sub"].parent_session_id == "main"
        and trees["sub"].parent_request_id == a[1].request_id
    )
    assert root_session(session_parents(trees), "subsub") == "main"
    assert len(trees["main"]) == 4


def test_root_session_refuses_a_cycle():
    assert root_session({"c": "b", "b": "a", "a": None}, "c") == "a"
    with pytest.raises(TreeError, match="cycle"):
        root_session({"a": "b", "b": "a"}, "a")


def test_long_rollout_builds_fast_and_exact():
    recs = long_rollout(n_calls=100, unique_tokens=100_000, reset_every=40, retry_every=7)
    tree = TrajectoryTree("long")
    tree.extend(recs)
    full = reconstruct_inputs(recs)
    for r in recs[::9]:
        expect = np.concatenate([full[r.request_id], np.asarray(r.output_ids, np.int32)])
        assert np.array_equal(tree.path_tokens(r.request_id), expect)
    assert tree.n_tokens == sum(len(r.new_input_ids) + len(r.output_ids) for r in recs)


def test_empty_call_ends_at_the_root():
    t = TrajectoryTree("s")
    t.add(rec("e", None, 0, [], []))
    t.add(rec("a", "e", 0, [1, 2], [3], seq=1))
    assert t.path_tokens("e").tolist() == [] and t.leaves() == ["a"]
    ft = t.flatten()
    assert ft.ends["e"] == -1 and ft.n_tokens == 3


@pytest.mark.slow
def test_500_call_rollout_builds_within_two_seconds():
    import time

    recs = long_rollout(n_calls=500, unique_tokens=1_000_000, reset_every=250)
    recs = [
        TitoRecord(
            r.run_id,
            r.session_id,
            r.request_id,
            r.seq_no,
            r.parent_request_id,
            r.prefix_len,
            list(r.new_input_ids),
            list(r.output_ids),
            list(r.output_logprobs),
            r.weight_version,
        )
        for r in recs
    ]
    t0 = time.perf_counter()
    tree = TrajectoryTree("long")
    tree.extend(recs)
    assert time.perf_counter() - t0 <= 2.0
    assert tree.n_tokens == sum(len(r.new_input_ids) + len(r.output_ids) for r in recs) > 990_000
    assert tree.n_flat_tokens > 100_000_000
