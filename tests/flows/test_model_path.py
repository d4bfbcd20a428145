"""`gyre run model.path=DIR` on a local checkpoint of another architecture family.

The tiny model in the Llama family (SmolLM2's architecture: no q/k norms, head_dim implied,
tied embedding) as ``model.path``: a real two-step run (Prefect flow, LocalCluster cells,
engines, gateway, trainer) publishes it as version 0, trains, checkpoints and syncs the new
weights to the engines (each load checked against the trainer's weights digest), evaluates
held-out tasks on each version, and exports. Checked through what a user sees: the ``steps``,
``tito`` and ``evals`` views, the run's checkpoints and ``gyre export``'s rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flows.export import export_run
from infra.engine.tiny_model import make_tiny_model
from storage.checkpoints import fetch_checkpoint, read_digest
from storage.sql import query
from storage.store import Store

pytestmark = pytest.mark.integration


def test_a_run_trains_and_serves_a_local_llama_checkpoint(prefect_harness, tmp_path):
    from flows.rl_run import rl_run

    model_dir = make_tiny_model(tmp_path / "tiny-llama", seed=0, arch="llama")
    store_url = str(tmp_path / "store")
    summary = rl_run(
        preset="tiny",
        store=store_url,
        run_id="llama",
        overrides=[f"model.path={model_dir}", "rollout.group_size=3", "eval.every=1"],
    )
    assert summary["steps"] == 2 and summary["weight_version"] == 2
    st = Store(store_url)
    steps = query(st, "SELECT step, weight_version FROM steps ORDER BY step").to_pylist()
    assert [(s["step"], s["weight_version"]) for s in steps] == [(0, 1), (1, 2)]
    # version 0 is the given checkpoint; every later one is a Llama of the same shape with
    # other weights, and carries the digest the engines checked when they loaded it
    v0 = load_file(str(Path(fetch_checkpoint(st, "llama", 0)) / "model.safetensors"))
    given = load_file(str(Path(model_dir) / "model.safetensors"))
    assert v0.keys() == given.keys() and all((v0[k] == given[k]).all() for k in v0)
    for v in (1, 2):
        ckpt = fetch_checkpoint(st, "llama", v)
        cfg = json.loads((Path(ckpt) / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
        w = load_file(str(Path(ckpt) / "model.safetensors"))
        assert {k for k in w if not k.startswith("lm_head")} == set(given)
        assert any(not (w[k] == given[k]).all() for k in given)
        assert read_digest(ckpt) is not None
    # the engines served the trained versions (weight sync), and each version was evaluated
    served = query(st, "SELECT DISTINCT weight_version AS v FROM tito ORDER BY 1").to_pylist()
    assert [r["v"] for r in served][:2] == [0, 1]
    evals = query(st, "SELECT DISTINCT version FROM evals ORDER BY 1").to_pylist()
    assert [r["version"] for r in evals] == [0, 1, 2]
    # the trajectories export as flat rows of this model's token ids
    n = export_run(st, "llama", str(tmp_path / "llama.parquet"))
    assert n > 0 and (tmp_path / "llama.parquet").stat().st_size > 0
