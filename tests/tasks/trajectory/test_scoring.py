"""Partial scoring: aggregations by hand, unreached sub-tasks, validation."""

from __future__ import annotations

import pyarrow as pa
import pytest

from storage.schemas import SCORES_SCHEMA
from tasks.trajectory.scoring import Score, ScoreError, aggregate, score_rollout, scores_at_requests


def s(sub, score, weight=1.0, at="r1", session="s", status="finished"):
    return Score("run", session, sub, score, weight, at, "harness", status, "")


def test_aggregations_by_hand():
    xs = [s("a", 1.0, 3.0), s("b", 0.5, 1.0), s("c", 0.0, 0.0)]
    assert aggregate(xs, "weighted_mean") == pytest.approx((3 * 1.0 + 0.5) / 4)
    assert aggregate(xs, "sum") == pytest.approx(3.5)
    assert aggregate(xs, "min") == 0.0
    assert aggregate(xs, "all_or_nothing") == 0.0
    assert aggregate([s("a", 1.0), s("b", 1.0)], "all_or_nothing") == 1.0
    assert aggregate([], "weighted_mean") == 0.0
    assert aggregate([], "all_or_nothing") == 0.0
    with pytest.raises(ScoreError, match="aggregation"):
        aggregate(xs, "median")


def test_timed_out_rollout_scores_what_it_finished():
    got = score_rollout(
        "run",
        "s",
        [s("t1", 1.0, 2.0), s("t2", 0.5), s("t1", 0.5, 2.0, session="other")],
        declared={"t1": 2.0, "t2": 1.0, "t3": 1.0},
        status="timeout",
        reason="wall clock 3600 s",
    )
    assert got.missing == ["t3"]
    assert got.reward == pytest.approx((2 * 1.0 + 0.5 + 0.0) / 4)
    (zero,) = [x for x in got.scores if x.subtask_id == "t3"]
    assert zero.score == 0.0 and zero.status == "timeout" and zero.at_request_id is None
    assert "not reached" in zero.reason and "3600" in zero.reason
    table = pa.Table.from_pylist([x.to_row() for x in got.scores], schema=SCORES_SCHEMA)
    assert table.num_rows == 3
    assert Score.from_row(table.to_pylist()[0]) == got.scores[0]


def test_failed_rollout_with_no_scores_still_counts():
    got = score_rollout(
        "run", "s", [], declared=["a", "b"], status="failed", reason="harness crashed"
    )
    assert got.reward == 0.0 and got.missing == ["a", "b"] and len(got.scores) == 2


def test_latest_report_wins_and_scores_at_requests():
    got = score_rollout("run", "s", [s("a", 0.2, at="r1"), s("a", 0.9, at="r5")])
    assert got.reward == pytest.approx(0.9)
    assert scores_at_requests(got.scores) == {"r5": 0.9}
    assert scores_at_requests([s("a", 0.2, at="r1"), s("b", 0.3, at="r1")]) == {
        "r1": pytest.approx(0.5)
    }


def test_invalid_scores_are_named():
    with pytest.raises(ScoreError, match=r"score=1.5"):
        s("a", 1.5)
    with pytest.raises(ScoreError, match="weight=-1"):
        s("a", 0.5, weight=-1.0)
    with pytest.raises(ScoreError, match="status"):
        s("a", 0.5, status="crashed")
    with pytest.raises(ScoreError, match="status"):
        score_rollout("run", "s", [], status="exploded")
