"""The learning side is reproducible: same seed, records and settings -> the same update,
bit for bit, on one machine (same torch thread count; see Trainer's docstring for what
breaks it). Checked in-process and against a fresh interpreter with another hash seed (set
and dict order over strings must not leak into samples or sums)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]

# Runs in both processes: synthetic rollouts -> samples (per sub-task credit, zero-variance
# filter, staleness) -> 3 optimizer steps with KL and entropy terms; prints the digests.
SCRIPT = r"""
import hashlib, sys
import numpy as np, torch
from transformers import AutoModelForCausalLM, Qwen3Config
from tasks.train.trainer import Trainer
from tasks.trajectory.sampler import build_samples
from tasks.trajectory.scoring import Score
from tasks.trajectory.synth import random_session
from tasks.trajectory.tree import build_trees

torch.set_num_threads(1)
out = sys.argv[1]
torch.manual_seed(0)
cfg = Qwen3Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
AutoModelForCausalLM.from_config(cfg).save_pretrained(out + "/m")
rng = np.random.default_rng(7)
recs, spans, scores, rewards, groups = [], {}, [], {}, {}
for i in range(6):
    sid = f"s{i}"
    r, sp = random_session(rng, n_calls=6, session_id=sid, vocab=40)
    recs += r
    spans |= sp
    groups[sid] = f"g{i % 3}"
    rewards[sid] = float(i % 2) if i < 4 else 1.0
    for j in range(2):
        at = r[int(rng.integers(len(r)))].request_id
        scores.append(Score("run", sid, f"t{j}", float(rng.choice([0.0, 1.0])), 1.0, at))
samples = build_samples(build_trees(recs, spans=spans), rewards, groups, advantage="per_subtask",
                        scores=scores, current_version=2, max_staleness=1)
tr = Trainer(out + "/m", lr=1e-2, seed=3, max_tokens_per_micro=64, kl_coef=0.1,
             entropy_coef=0.01, temperature=0.8)
metrics = [tr.step(samples) for _ in range(3)]
h = hashlib.sha256()
for n, p in tr.model.named_parameters():
    h.update(n.encode() + p.detach().numpy().tobytes())
print("params", h.hexdigest())
print("loss", repr([m["train/loss"] for m in metrics]))
"""


def run_here(tmp: Path) -> list[str]:
    import contextlib
    import io

    buf = io.StringIO()
    n = torch.get_num_threads()
    argv = sys.argv
    try:
        sys.argv = ["x", str(tmp)]
        with contextlib.redirect_stdout(buf):
            exec(compile(SCRIPT, "reproducible", "exec"), {"__name__": "__repro__"})
    finally:
        sys.argv = argv
        torch.set_num_threads(n)
    return buf.getvalue().split("\n")


def test_same_inputs_same_update_bit_for_bit(tmp_path):
    a = run_here(tmp_path / "a")
    b = run_here(tmp_path / "b")
    assert a == b and a[0].startswith("params ")


@pytest.mark.slow
def test_a_fresh_interpreter_with_another_hash_seed_gives_the_same_bits(tmp_path):
    a = run_here(tmp_path / "a")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(ROOT))
    (tmp_path / "c").mkdir()
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "c")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert out.stdout.split("\n") == a, out.stderr[-2000:]
