"""Trajectory sampling: weights by hand, reference-vs-fast weights, staleness, rows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from storage.schemas import SAMPLES_SCHEMA
from storage.tito import TitoRecord
from tasks.trajectory.sampler import (
    Sample,
    SamplingError,
    ScoreLocationError,
    build_samples,
    group_advantages,
    zero_variance_groups,
)
from tasks.trajectory.scoring import Score
from tasks.trajectory.synth import random_session, reference_paths
from tasks.trajectory.tree import POLICY, TrajectoryTree, build_trees


def rec(rid, parent, k, new, out, v=0, seq=0, session="s"):
    return TitoRecord("run", session, rid, seq, parent, k, new, out, [-1.0] * len(out), v)


def small_tree(session="s", versions=(0, 0, 0, 0)):
    """a: [1 2 | 3 4]; b retries a's output: [1 2 | 5 6]; c extends a: [.. 3 4 | 7 | 8];
    d extends c with trailing input only: [.. 8 | 9]. Leaves: b, d."""
    t = TrajectoryTree(session)
    t.add(rec("a", None, 0, [1, 2], [3, 4], versions[0], 0, session))
    t.add(rec("b", "a", 2, [], [5, 6], versions[1], 1, session))
    t.add(rec("c", "a", 4, [7], [8], versions[2], 2, session))
    t.add(rec("d", "c", 6, [9], [], versions[3], 3, session))
    return t


def as_dict(sample):
    return {
        int(t): (float(p), float(n))
        for t, p, n in zip(sample.token_ids, sample.weight_pos, sample.weight_neg, strict=True)
    }


def test_weights_by_hand_and_pruning():
    (smp,) = build_samples([small_tree()], {"s": 0.5}, advantage="reward", run_id="run", step=3)
    # token 9 (trailing harness input of d) trains nothing: pruned
    assert smp.token_ids.tolist() == [1, 2, 3, 4, 7, 8, 5, 6]
    assert smp.parent_idx.tolist() == [-1, 0, 1, 2, 3, 4, 1, 6]
    assert smp.positions.tolist() == [0, 1, 2, 3, 4, 5, 2, 3]
    assert as_dict(smp) == {
        1: (0, 0),
        2: (0, 0),
        3: (0.5, 0),
        4: (0.5, 0),
        7: (0, 0),
        8: (0.5, 0),
        5: (0.5, 0),
        6: (0.5, 0),
    }
    assert smp.n_trainable == 5 and smp.n_tokens == 8
    assert smp.n_flat_trainable == 2 + 3  # b: 5 6; d: 3 4 8
    assert smp.n_flat_tokens == 4 + 7
    assert smp.versions.tolist() == [-1, -1, 0, 0, -1, 0, 0, 0]
    assert smp.behaviour_logprobs.tolist() == [0, 0, -1, -1, 0, -1, -1, -1]
    assert smp.sample_id == "run/3/s" and smp.reward == 0.5


def test_shared_prefix_weight_is_sum_over_branches_and_signs_split():
    t = TrajectoryTree("s")
    t.add(rec("a", None, 0, [1], [2, 3]))
    t.add(rec("b", "a", 3, [4], [5]))
    t.add(rec("c", "a", 3, [6], [7]))
    (pos,) = build_samples([t], {"s": 1.0}, advantage="reward")
    assert as_dict(pos)[2] == (2.0, 0.0)  # two branches through a's output
    # GRPO: two rollouts of one task, rewards 1 and 0 -> advantages (1 - 0.5) / 0.5 = +1, -1
    t2 = TrajectoryTree("u")
    t2.add(rec("x", None, 0, [1], [2, 3], session="u"))
    t2.add(rec("y", "x", 3, [4], [5], session="u"))
    smps = build_samples([t, t2], {"s": 1.0, "u": 0.0}, {"s": "g", "u": "g"}, eps=0.0)
    w = {s.session_id: as_dict(s) for s in smps}
    assert w["s"][2] == pytest.approx((2.0, 0.0)) and w["s"][7] == pytest.approx((1.0, 0.0))
    assert w["u"][2] == pytest.approx((0.0, -1.0)) and w["u"][5] == pytest.approx((0.0, -1.0))


def test_group_advantages():
    adv = group_advantages({"a": 1.0, "b": 0.0, "c": 0.5, "d": 0.7}, {"a": "g", "b": "g"}, eps=0.0)
    assert adv["a"] == pytest.approx(1.0) and adv["b"] == pytest.approx(-1.0)
    assert adv["c"] == 0.0 and adv["d"] == 0.0  # singletons
    adv = group_advantages({"a": 1.0, "b": 0.0}, {"a": "g", "b": "g"}, normalize_std=False)
    assert adv == {"a": 0.5, "b": -0.5}


def test_staleness_drop_and_is():
    t = small_tree(versions=(0, 2, 2, 2))
    (drop,) = build_samples([t], {"s": 1.0}, advantage="reward", current_version=3, max_staleness=1)
    w = as_dict(drop)
    assert w[3] == (0, 0) and w[4] == (0, 0) and w[5] == (1, 0) and w[8] == (1, 0)
    assert drop.n_flat_trainable == 2 + 1
    (keep,) = build_samples(
        [t], {"s": 1.0}, advantage="reward", current_version=3, max_staleness=1, stale_policy="is"
    )
    assert as_dict(keep)[3] == (1, 0) and keep.versions[2] == 0
    with pytest.raises(SamplingError, match="current_version"):
        build_samples([t], {"s": 1.0}, max_staleness=1)


def test_per_subtask_credit_follows_the_branch():
    t = small_tree()  # leaves b (path a-in, b-out) and d (a-in, a-out, c, d)
    u = TrajectoryTree("u")
    u.add(rec("x", None, 0, [1], [2], session="u"))
    scores = [
        Score("run", "s", "t1", 1.0, 1.0, "b"),
        Score("run", "s", "t2", 0.0, 1.0, None, "scoring", "unfinished", "not reached"),
        Score("run", "u", "t1", 0.0, 1.0, "x"),
        Score("run", "u", "t2", 1.0, 1.0, "x"),
    ]
    smps = build_samples(
        [t, u],
        {"s": 0.5, "u": 0.5},
        {"s": "g", "u": "g"},
        advantage="per_subtask",
        scores=scores,
        normalize_std=False,
    )
    w = {s.session_id: as_dict(s) for s in smps}
    # branch b: t1 (+0.5, earned on b) and t2 (-0.5, never reached) at weight 1/2 each -> 0
    assert w["s"][5] == pytest.approx((0.0, 0.0))
    # branch d: only t2 -> -0.25 on a's output, c's output
    assert w["s"][3] == pytest.approx((0.0, -0.25)) and w["s"][8] == pytest.approx((0.0, -0.25))
    assert w["u"][2] == pytest.approx((0.0, 0.0))


def test_sub_agent_tree_takes_its_root_reward():
    a, _ = random_session(np.random.default_rng(0), n_calls=3, session_id="main")
    b, _ = random_session(np.random.default_rng(1), n_calls=3, session_id="sub")
    trees = build_trees(a + b, session_parents={"sub": "main"})
    smps = build_samples(trees, {"main": 1.0}, advantage="reward")
    assert {s.session_id: s.reward for s in smps} == {"main": 1.0, "sub": 1.0}
    with pytest.raises(SamplingError, match="no reward"):
        build_samples(trees, {"other": 1.0})
    # GRPO: the sub-agent's tokens carry its rollout's (here negative) advantage, not 0
    c, _ = random_session(np.random.default_rng(2), n_calls=2, session_id="peer")
    trees = build_trees(a + b + c, session_parents={"sub": "main"})
    smps = build_samples(trees, {"main": 0.0, "peer": 1.0}, dict.fromkeys(["main", "peer"], "g"))
    sub = next(s for s in smps if s.session_id == "sub")
    w = sub.weight_neg[sub.counts > 0] / sub.counts[sub.counts > 0]
    assert w.size and np.allclose(w, -0.5 / (0.5 + 1e-6), rtol=1e-12) and not sub.weight_pos.any()


def test_rows_round_trip_through_schema():
    (smp,) = build_samples([small_tree()], {"s": 0.25}, advantage="reward", run_id="run")
    table = pa.Table.from_pylist([smp.to_row()], schema=SAMPLES_SCHEMA)
    back = Sample.from_row(table.to_pylist()[0])
    for f in ("token_ids", "parent_idx", "positions", "weight_pos", "weight_neg", "versions"):
        assert np.array_equal(getattr(back, f), getattr(smp, f))
    assert back.n_flat_trainable == smp.n_flat_trainable and back.sample_id == smp.sample_id


@pytest.mark.parametrize("seed", range(30))
def test_weights_match_per_branch_reference(seed):
    """Fast (node sums) vs slow (walk every leaf path) token weights and counts."""
    rng = np.random.default_rng(seed)
    recs, spans = random_session(
        rng, n_calls=int(rng.integers(1, 20)), vocab=int(rng.choice([3, 40]))
    )
    tree = TrajectoryTree("s0")
    tree.extend(recs, spans)
    (smp,) = build_samples([tree], {"s0": 0.7}, advantage="reward", prune=False)
    ref = reference_paths(recs, spans)
    ft = tree.flatten()
    want = np.zeros(ft.n_tokens)
    n_flat = 0
    for rid in tree.leaves():
        e = ft.ends[rid]
        i = int(ft.node_offset[e] + ft.node_length[e]) - 1
        path = []
        while i >= 0:
            path.append(i)
            i = int(ft.parent_idx[i])
        path = np.array(path[::-1], dtype=np.int64)
        tok, prov, _, _ = ref[rid]
        assert np.array_equal(ft.token_ids[path], tok)
        train = (prov == POLICY) & (np.arange(len(path)) > 0)
        want[path[train]] += 0.7
        n_flat += int(train.sum())
    assert np.allclose(smp.weight_pos, want) and smp.n_flat_trainable == n_flat
    # leaves are exactly the calls no other call's path extends (duplicates once)
    ctx = {r.request_id: ref[r.request_id][0] for r in recs}
    ends = {}
    for r in recs:
        extended = any(
            len(ctx[o.request_id]) > len(ctx[r.request_id])
            and np.array_equal(ctx[o.request_id][: len(ctx[r.request_id])], ctx[r.request_id])
            and np.array_equal(ref[o.request_id][1][: len(ctx[r.request_id])], ref[r.request_id][1])
            and np.array_equal(ref[o.request_id][2][: len(ctx[r.request_id])], ref[r.request_id][2])
            for o in recs
        )
        if not extended:
            ends.setdefault(tree.end_node(r.request_id).id, r.request_id)
    assert sorted(ends.values()) == sorted(tree.leaves())


def test_flat_layout_is_one_chain_per_branch():
    flat = build_samples([small_tree()], {"s": 0.5}, advantage="reward", layout="flat")
    got = {
        s.sample_id.rsplit("/", 1)[1]: (s.token_ids.tolist(), s.weight_pos.tolist()) for s in flat
    }
    assert got == {
        "b": ([1, 2, 5, 6], [0, 0, 0.5, 0.5]),
        "d": ([1, 2, 3, 4, 7, 8], [0, 0, 0.5, 0.5, 0, 0.5]),  # trailing 9 cut
    }
    assert all(np.array_equal(s.parent_idx, np.arange(s.n_tokens) - 1) for s in flat)
    (tree,) = build_samples([small_tree()], {"s": 0.5}, advantage="reward")
    assert sum(s.n_flat_trainable for s in flat) == tree.n_flat_trainable
    assert sum(s.n_flat_tokens for s in flat) == tree.n_flat_tokens


def test_zero_variance_groups_are_dropped_and_listed():
    """Equal rewards (and a group of one) carry no signal: no samples, out of the normaliser."""
    trees = [small_tree(sid) for sid in ("a", "b", "c", "d", "e")]
    rewards = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0, "e": 0.3}
    groups = {"a": "flat", "b": "flat", "c": "live", "d": "live", "e": "alone"}
    assert zero_variance_groups(rewards, groups) == ["flat", "alone"]
    assert zero_variance_groups(rewards, groups, advantage="reward") == []
    kept = build_samples(trees, rewards, groups)
    assert sorted(s.session_id for s in kept) == ["c", "d"]
    everything = build_samples(trees, rewards, groups, filter_zero_variance=False)
    assert len(everything) == 5
    flat = [s for s in everything if s.group_id in ("flat", "alone")]
    assert all(not s.weight_pos.any() and not s.weight_neg.any() for s in flat)
    assert all(s.n_flat_trainable > 0 for s in flat)  # they would have diluted the mean
    # equal rewards that do not average exactly still give exactly 0
    assert set(
        group_advantages({"x": 0.1, "y": 0.1, "z": 0.1}, dict.fromkeys("xyz", "g")).values()
    ) == {0.0}


def retry_tree(first: float, second: float, session="s"):
    """Call a answers sub-task t1 (score ``first``); call b retries from a's input (a branch)
    and answers it again (``second``)."""
    t = TrajectoryTree(session)
    t.add(rec("a", None, 0, [1, 2], [3, 4], session=session))
    t.add(rec("b", "a", 2, [], [5, 6], seq=1, session=session))
    scores = [
        Score("run", session, "t1", first, 1.0, "a"),
        Score("run", session, "t1", second, 1.0, "b"),
    ]
    return t, scores


@pytest.mark.parametrize(("first", "second"), [(0.0, 1.0), (1.0, 0.0), (0.5, 1.0)])
def test_a_worse_retry_gets_a_lower_advantage_than_the_branch_that_succeeded(first, second):
    t, scores = retry_tree(first, second)
    u = TrajectoryTree("u")
    u.add(rec("x", None, 0, [1], [2], session="u"))
    scores.append(Score("run", "u", "t1", 1.0, 1.0, "x"))
    smps = build_samples(
        [t, u], {"s": 0.5, "u": 1.0}, {"s": "g", "u": "g"}, advantage="per_subtask", scores=scores
    )
    w = as_dict(next(s for s in smps if s.session_id == "s"))
    adv_a, adv_b = sum(w[3]), sum(w[5])  # a's and b's own output tokens
    worse, better = (adv_a, adv_b) if first < second else (adv_b, adv_a)
    assert worse < better and worse < 0
    # by hand: attempts of t1 in the group are [first, second, 1.0] (all of them)
    x = np.array([first, second, 1.0])
    norm = (x - x.mean()) / (x.std() + 1e-6)
    assert (adv_a, adv_b) == pytest.approx((norm[0], norm[1]))


def test_per_subtask_normalises_by_the_group_std_unless_told_not_to():
    trees = [TrajectoryTree(sid) for sid in "abc"]
    for i, t in enumerate(trees):
        t.add(rec("r", None, 0, [1], [2 + i], session=t.session_id))
    scores = [
        Score("run", sid, "t", sc, 1.0, "r") for sid, sc in zip("abc", (1.0, 0.0, 0.0), strict=True)
    ]
    rewards, groups = dict.fromkeys("abc", 0.0), dict.fromkeys("abc", "g")

    def adv(**kw):
        smps = build_samples(trees, rewards, groups, advantage="per_subtask", scores=scores, **kw)
        return {s.session_id: sum(as_dict(s)[2 + "abc".index(s.session_id)]) for s in smps}

    std = np.std([1.0, 0.0, 0.0])
    assert adv() == pytest.approx(
        {"a": (2 / 3) / (std + 1e-6), "b": (-1 / 3) / (std + 1e-6), "c": (-1 / 3) / (std + 1e-6)}
    )
    assert adv(normalize_std=False) == pytest.approx({"a": 2 / 3, "b": -1 / 3, "c": -1 / 3})


def test_a_score_at_a_request_outside_the_tree_is_refused():
    t, scores = retry_tree(1.0, 0.0)
    bad = [*scores, Score("run", "s", "t2", 1.0, 1.0, "not-a-call")]
    with pytest.raises(ScoreLocationError, match="not-a-call"):
        build_samples([t], {"s": 1.0}, advantage="per_subtask", scores=bad)
    assert issubclass(ScoreLocationError, SamplingError)
    # a rollout with no calls cannot have earned anything at a call either
    orphan = [Score("run", "gone", "t1", 1.0, 1.0, "r1")]
    with pytest.raises(ScoreLocationError, match="gone"):
        build_samples([t], {"s": 1.0, "gone": 0.0}, advantage="per_subtask", scores=scores + orphan)


def test_a_policy_token_at_the_root_is_context_not_a_target():
    """A call with an empty input: its first output token has nothing to be predicted from."""
    t = TrajectoryTree("s")
    t.add(rec("a", None, 0, [], [3, 4, 5]))
    (smp,) = build_samples([t], {"s": 1.0}, advantage="reward")
    assert smp.token_ids.tolist() == [3, 4, 5]
    assert smp.weight_pos.tolist() == [0.0, 1.0, 1.0] and smp.counts.tolist() == [0, 1, 1]
    assert smp.n_flat_trainable == 2
