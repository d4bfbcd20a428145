"""The warm start (``gyre warmstart``) and what a run reports of its held-out evaluations.

The run itself (evaluations pinned to one version, never trained on) is checked end to end in
tests/flows/test_learning_run.py.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from flows.cli import main
from flows.evaluation import curve_png, learning_summary, write_learning
from flows.warmstart import DEMO_SEED0, WarmStartConfig, build_warmstart, default_dir, spec
from storage.store import Store

TINY_WS = WarmStartConfig(enabled=True, steps=2, demos=4, batch_size=2, lr=3e-3)


def _weights(path: str) -> dict:
    return load_file(str(Path(path) / "model.safetensors"))


def test_warm_start_is_built_once_deterministic_and_loadable(tmp_path: Path):
    from transformers import AutoModelForCausalLM

    said, bar = [], io.StringIO()
    a, meta = build_warmstart(TINY_WS, suite="tools", difficulty=0, subtasks=1,
                              out=tmp_path / "a", say=said.append, progress=bar)  # fmt: skip
    assert not meta["cached"] and meta["steps"] == 2 and meta["conversations"] == 4
    # minutes of training say so first, then show steps and loss as they go
    assert len(said) == 1 and "2 supervised steps" in said[0]
    last = bar.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert "warm start" in last and "2/2" in last and f"loss {meta['final_loss']:.4f}" in last
    assert meta["spec"]["demo_seed0"] == DEMO_SEED0 and meta["seconds"] >= 0
    stamp = (Path(a) / "model.safetensors").stat().st_mtime_ns
    again, meta2 = build_warmstart(
        TINY_WS, suite="tools", difficulty=0, subtasks=1, out=tmp_path / "a"
    )
    assert again == a and meta2["cached"]
    assert (Path(a) / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    b, _ = build_warmstart(TINY_WS, suite="tools", difficulty=0, subtasks=1, out=tmp_path / "b")
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    assert all((wa[k] == wb[k]).all() for k in wa)  # bit for bit
    # other settings, same directory: rebuilt, not silently reused
    other = TINY_WS.model_copy(update={"seed": 1})
    _, meta3 = build_warmstart(other, suite="tools", difficulty=0, subtasks=1, out=tmp_path / "a")
    assert not meta3["cached"] and meta3["spec"]["seed"] == 1
    assert any((wa[k] != _weights(a)[k]).any() for k in wa)
    AutoModelForCausalLM.from_pretrained(a)  # a checkpoint `model.path` can name


def test_default_dir_names_the_suite_and_hashes_the_settings():
    s = spec(TINY_WS, suite="tools", difficulty=1, subtasks=3, model_seed=0)
    d = default_dir(s)
    assert d.name.startswith("tools-d1-") and d.parent.name == "warmstart"
    assert default_dir({**s, "steps": 3}) != d
    assert default_dir(spec(TINY_WS, suite="tools", difficulty=1, subtasks=3, model_seed=0)) == d


def test_gyre_warmstart_cli(tmp_path: Path, capsys):
    out = tmp_path / "ws"
    argv = ["warmstart", "--suite", "tools", "--difficulty", "0", "--subtasks", "1"]
    argv += ["--steps", "2", "--demos", "4", "--batch-size", "2", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "model.path=" in printed and "built in" in printed
    assert main(argv) == 0
    assert "cached" in capsys.readouterr().out
    assert main(["warmstart", "--suite", "arith", "--out", str(tmp_path / "x")]) == 2
    assert "no demonstrations" in capsys.readouterr().err
    assert main(["warmstart", "--suite", "nope.module:X", "--out", str(tmp_path / "y")]) == 2
    assert main(["warmstart", "--steps", "0", "--out", str(tmp_path / "z")]) == 2


def _evals(run_id: str, rewards: dict[int, list[tuple[str, float]]]) -> list[dict]:
    rows = []
    for version, items in rewards.items():
        for k, (task_id, r) in enumerate(items):
            rows.append(
                {
                    "run_id": run_id,
                    "version": version,
                    "step": version,
                    "seed": 100 + k,
                    "task_id": task_id,
                    "session_id": f"s{version}-{k}",
                    "status": "finished",
                    "reward": r,
                    "subtask_ids": ["q0"],
                    "subtask_scores": [r],
                }
            )
    return rows


def test_learning_summary_by_hand(tmp_path: Path):
    st = Store(str(tmp_path / "store"))
    st.append(
        "evals",
        _evals("r1", {0: [("a", 0.5), ("b", 0.0)], 2: [("a", 1.0), ("b", 0.5)], 4: [("a", 1.0), ("b", 1.0)]})
        + _evals("other", {0: [("a", 0.9)]}),
    )  # fmt: skip
    s = learning_summary(st, "r1")
    assert s["reward_before"] == 0.25 and s["reward_after"] == 1.0 and s["reward_gain"] == 0.75
    assert s["reward_before_se"] == pytest.approx(0.25)  # sample std 0.3536 / sqrt(2)
    assert s["reward_after_se"] == 0.0 and s["eval_tasks"] == 2
    assert [(c["step"], c["reward"]) for c in s["curve"]] == [(0, 0.25), (2, 0.75), (4, 1.0)]
    assert s["per_task"] == {
        "a": {"before": 0.5, "after": 1.0, "n": 1},
        "b": {"before": 0.0, "after": 1.0, "n": 1},
    }
    assert learning_summary(st, "nobody") == {}


def test_write_learning_puts_summary_json_and_the_curve_in_the_run_dir(tmp_path: Path):
    st = Store(str(tmp_path / "store"))
    st.append("evals", _evals("r1", {0: [("a", 0.25)], 3: [("a", 0.75)]}))
    out = write_learning(st, "r1", {"run_id": "r1", "steps": 3})
    assert out["reward_before"] == 0.25 and out["reward_after"] == 0.75
    assert out["curve"] == "0:0.250 3:0.750"
    saved = json.loads(st.read_bytes("runs/r1/summary.json"))
    assert saved["steps"] == 3 and saved["learning"]["per_task"]["a"]["after"] == 0.75
    png = st.read_bytes("runs/r1/learning.png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5_000
    # a run without evaluations still gets its summary.json, and no curve
    out = write_learning(st, "r2", {"run_id": "r2"})
    assert "reward_before" not in out and not st.exists("runs/r2/learning.png")
    assert json.loads(st.read_bytes("runs/r2/summary.json")) == {"run_id": "r2"}


def test_curve_png_plots_training_rewards_too():
    curve = [{"step": 0, "reward": 0.2, "se": 0.05}, {"step": 4, "reward": 0.6, "se": 0.04}]
    png = curve_png(curve, [{"step": 0, "reward": 0.1}, {"step": 3, "reward": 0.5}], "t")
    assert png[:4] == b"\x89PNG"


def test_a_run_can_warm_start_on_an_easier_level(tmp_path: Path, monkeypatch):
    from flows.config import load_config
    from flows.warmstart import for_run

    monkeypatch.setenv("GYRE_CACHE", str(tmp_path / "cache"))
    over = ["rollout.suite=tools", "rollout.difficulty=1", "rollout.subtasks=1"]
    over += ["warmstart.enabled=true", "warmstart.steps=2", "warmstart.demos=4"]
    over += ["warmstart.batch_size=2"]
    at_run_level = for_run(load_config(overrides=over))
    easier = for_run(load_config(overrides=[*over, "warmstart.difficulty=0"]))
    assert Path(at_run_level).name.startswith("tools-d1-")
    assert Path(easier).name.startswith("tools-d0-")
    meta = json.loads((Path(easier) / "warm_start.json").read_text())
    assert meta["spec"]["difficulty"] == 0
