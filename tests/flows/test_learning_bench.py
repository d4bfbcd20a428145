"""bench/learning.py's arithmetic (issue 16): the held-out gain paired per task, its standard
error, and the engine-busy time of overlapping calls; checked on hand-worked cases."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import learning  # bench/learning.py


def _summary(per_task: dict[str, tuple[float, float]]) -> dict:
    return {
        "learning": {"per_task": {k: {"before": b, "after": a} for k, (b, a) in per_task.items()}}
    }


def test_union_of_call_spans():
    assert learning._union_s([]) == 0.0
    # two calls overlapping on [2, 3], one inside another, one apart: 0-4 and 6-7
    assert learning._union_s([(0, 3), (2, 4), (1, 2), (6, 7)]) == pytest.approx(5.0)
    assert learning._union_s([(5, 6), (0, 1)]) == pytest.approx(2.0)


def test_paired_gain_and_standard_error_by_hand():
    # seed 0: tasks a, b (before -> after); seed 1: tasks a, b; control never moves
    rows = [
        {
            "rl": _summary({"a": (0.0, 1 / 3), "b": (1 / 3, 1 / 3)}),
            "control": _summary({"a": (0.0, 0.0), "b": (1 / 3, 1 / 3)}),
        },
        {
            "rl": _summary({"a": (0.0, 2 / 3), "b": (1 / 3, 2 / 3)}),
            # greedy frozen weights can still flip a near-tie: the control's task a moves
            "control": _summary({"a": (0.0, 1 / 3), "b": (1 / 3, 1 / 3)}),
        },
    ]
    gain, se, over, over_se = learning.paired_gains(rows)
    # gains 1/3, 0, 2/3, 1/3: mean 1/3, sample sd sqrt(2/27), s.e. sd / 2
    assert gain == pytest.approx(1 / 3)
    assert se == pytest.approx((2 / 27) ** 0.5 / 2)
    # after minus the control's after: 1/3, 0, 1/3, 1/3: mean 1/4, sample sd 1/6, s.e. 1/12
    assert (over, over_se) == (pytest.approx(1 / 4), pytest.approx(1 / 12))
    # a task the control lacks is not paired: 1/3, 1/3, 1/3 are left
    rows[0]["control"]["learning"]["per_task"].pop("b")
    assert learning.paired_gains(rows)[2:] == (pytest.approx(1 / 3), pytest.approx(0.0))
    assert learning.paired_gains([]) == (0.0, 0.0, 0.0, 0.0)


def test_saved_seeds_are_reused_not_rerun(tmp_path, monkeypatch, capsys):
    """``--rows DIR``: a seed whose row an earlier invocation saved is read back, not run
    again, and counts in the figures like a seed run now."""

    def no_run(*a, **k):
        raise AssertionError("a saved seed was run again")

    monkeypatch.setattr(learning, "run", no_run)
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    for seed, after in ((0, 2 / 3), (1, 1 / 3)):
        rl = _summary({"a": (0.0, after)}) | {"reward_before": 0.0, "reward_after": after}
        ctl = _summary({"a": (0.0, 0.0)}) | {"reward_before": 0.0, "reward_after": 0.0}
        for s in (rl, ctl):
            s |= {"curve": "", "wall_s": 10.0}
        row = {"seed": seed, "store": str(tmp_path), "rl": rl, "control": ctl}
        (rows_dir / f"demo-s{seed}.json").write_text(learning.json.dumps(row))
    out = tmp_path / "figures.json"
    assert learning.main(["--seeds", "0", "1", "--rows", str(rows_dir), "--json", str(out)]) == 0
    figures = learning.json.loads(out.read_text())
    assert figures["reward_gain"] == pytest.approx(0.5)
    assert figures["seeds"] == [0, 1] and figures["seeds_beating_control"] == 2
    printed = capsys.readouterr().out.splitlines()
    assert sum(line.startswith(("seed 0: reused", "seed 1: reused")) for line in printed) == 2
