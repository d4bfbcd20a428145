"""`gyre run model.path=DIR` on a local HF checkpoint of each supported family.

A checkpoint as a user brings it: a random model built from transformers' own config class
(`LlamaConfig`, `Qwen2Config`, `Qwen3Config`), saved with ``save_pretrained`` beside a
tokenizer, each with what sets its family apart (`FAMILIES`): Llama as SmolLM2 (no q/k norms,
``head_dim`` implied, tied embedding, rope_theta 1e5), Qwen2 with q/k/v biases (drawn, not
the zeros transformers gives them, so a model that ignored them would show) and an untied
head, Qwen3 with q/k norms, an explicit ``head_dim`` other than hidden / heads and an untied
head. Each runs for real (Prefect flow, LocalCluster cells, engines, gateway, trainer): a
warm start from that checkpoint (``warmstart.enabled``: the run's version 0), two RL steps
whose checkpoints the engines load (each load checked against the trainer's weights digest),
held-out evaluations of every version, and ``gyre export``. Checked through what a user sees:
the ``steps``, ``tito`` and ``evals`` views, the run's checkpoints and the exported rows.

The Llama run is in the default suite (as the arithmetic Llama run it replaces); Qwen2 and
Qwen3 (the same run, about 2 minutes each on a loaded 2-core machine) are slow. The warm start
from each family's checkpoint is also checked on its own, in seconds, in the default suite.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flows.export import export_run
from infra.engine.tiny_model import make_tiny_model
from storage.checkpoints import fetch_checkpoint, read_digest, weights_digest
from storage.sql import query
from storage.store import Store

pytestmark = pytest.mark.integration

_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
# the family's config class, its settings, and the HF architecture it saves as
FAMILIES = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": True, "rope_theta": 100_000.0}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False, "rope_theta": 1_000_000.0}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False, "head_dim": 32}),
}
ARCHITECTURE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM"}  # fmt: skip


def family_checkpoint(arch: str, out: Path, seed: int = 0) -> str:
    """A random ``arch`` model saved with ``save_pretrained``, with the tiny tokenizer."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(make_tiny_model())
    cls, extra = FAMILIES[arch]
    config = getattr(transformers, cls)(
        vocab_size=len(tok),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        **_SHAPE,
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # Qwen2's q/k/v biases
                p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    GenerationConfig(
        eos_token_id=[tok.eos_token_id, tok.pad_token_id], pad_token_id=tok.pad_token_id
    ).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_a_warm_start_begins_from_the_given_checkpoint(arch, tmp_path, monkeypatch):
    """``warmstart.enabled`` with ``model.path``: the run starts from a warm start *of that
    checkpoint* (not of the tiny model), cached by the checkpoint's contents."""
    from flows.config import load_config
    from flows.rl_run import model_dir_of
    from flows.warmstart import fingerprint

    monkeypatch.setenv("GYRE_CACHE", str(tmp_path / "cache"))
    model_dir = family_checkpoint(arch, tmp_path / arch)
    over = [f"model.path={model_dir}", "rollout.suite=tools", "rollout.difficulty=0"]
    over += ["rollout.subtasks=1", "warmstart.enabled=true", "warmstart.steps=2"]
    over += ["warmstart.demos=4", "warmstart.batch_size=2"]
    said: list[str] = []
    ws = model_dir_of(load_config(overrides=over), say=said.append)
    assert Path(ws).parent == tmp_path / "cache" / "warmstart" and len(said) == 1
    meta = json.loads((Path(ws) / "warm_start.json").read_text())
    assert meta["base"] == arch and meta["spec"]["base"] == fingerprint(model_dir)
    assert meta["final_loss"] < meta["first_loss"] * 1.5  # it trained (2 steps: roughly)
    given = load_file(str(Path(model_dir) / "model.safetensors"))
    w = load_file(str(Path(ws) / "model.safetensors"))
    assert w.keys() == given.keys() and any(not (w[k] == given[k]).all() for k in w)
    cfg = json.loads((Path(ws) / "config.json").read_text())
    assert cfg["architectures"] == [ARCHITECTURE[arch]]
    assert cfg["tie_word_embeddings"] == (arch == "llama")
    # cached: the same settings and checkpoint give the same directory, not rebuilt
    assert model_dir_of(load_config(overrides=over), say=said.append) == ws and len(said) == 1
    # another checkpoint at the same path is another base: a new warm start
    other = family_checkpoint(arch, tmp_path / arch, seed=1)
    assert other == model_dir
    assert model_dir_of(load_config(overrides=over), say=said.append) != ws and len(said) == 2


@pytest.mark.parametrize(
    "arch",
    ["llama", pytest.param("qwen2", marks=pytest.mark.slow),
     pytest.param("qwen3", marks=pytest.mark.slow)],
)  # fmt: skip
def test_a_run_warm_starts_trains_serves_evaluates_and_exports_a_local_checkpoint(
    arch, prefect_harness, tmp_path, monkeypatch
):
    from flows.rl_run import rl_run

    monkeypatch.setenv("GYRE_CACHE", str(tmp_path / "cache"))  # the warm start built fresh
    model_dir = family_checkpoint(arch, tmp_path / arch)
    given = load_file(str(Path(model_dir) / "model.safetensors"))
    assert ("lm_head.weight" in given) == (arch != "llama")  # tied only in the Llama
    assert any(k.endswith("q_proj.bias") for k in given) == (arch == "qwen2")
    assert any(k.endswith("q_norm.weight") for k in given) == (arch == "qwen3")
    store_url = str(tmp_path / "store")
    summary = rl_run(
        preset="tiny",
        store=store_url,
        run_id=arch,
        overrides=[
            f"model.path={model_dir}",
            *("rollout.suite=tools", "rollout.difficulty=0", "rollout.subtasks=1"),
            *("rollout.group_size=3", "rollout.max_new_tokens=16", "eval.every=1"),
            *("warmstart.enabled=true", "warmstart.steps=2", "warmstart.demos=4"),
            "warmstart.batch_size=2",
        ],
    )
    assert summary["steps"] == 2 and summary["weight_version"] == 2
    st = Store(store_url)
    steps = query(st, "SELECT step, weight_version FROM steps ORDER BY step").to_pylist()
    assert [(s["step"], s["weight_version"]) for s in steps] == [(0, 1), (1, 2)]
    # version 0 is the warm start of the given checkpoint (built from it, cached under
    # GYRE_CACHE), the same family and tensors, other numbers
    (warm,) = (tmp_path / "cache" / "warmstart").glob("tools-d0-*")
    meta = json.loads((warm / "warm_start.json").read_text())
    assert meta["base"] == arch and meta["steps"] == 2
    v0 = load_file(str(Path(fetch_checkpoint(st, arch, 0)) / "model.safetensors"))
    ws = load_file(str(warm / "model.safetensors"))
    assert v0.keys() == ws.keys() == given.keys()
    assert all((v0[k] == ws[k]).all() for k in v0)
    assert any(not (v0[k] == given[k]).all() for k in given)
    from transformers import AutoModelForCausalLM

    # each step's checkpoint: the family's config, and new numbers iff the step had samples
    # (a random model's groups often score alike: zero-variance groups carry no gradient)
    n_samples = query(st, "SELECT n_samples FROM steps ORDER BY step").column(0).to_pylist()
    prev = v0
    for v in (1, 2):
        ckpt = fetch_checkpoint(st, arch, v)
        cfg = json.loads((Path(ckpt) / "config.json").read_text())
        assert cfg["architectures"] == [ARCHITECTURE[arch]] and cfg["model_type"] == arch
        assert cfg["tie_word_embeddings"] == (arch == "llama")
        w = load_file(str(Path(ckpt) / "model.safetensors"))
        assert w.keys() == given.keys()
        assert any(not (w[k] == prev[k]).all() for k in w) == (n_samples[v - 1] > 0)
        prev = w
        # the digest the engines checked each load against is the one of the checkpoint's
        # weights as transformers loads them (what the engine serves)
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        assert read_digest(ckpt)["sha256"] == weights_digest(model)
    # the engines served the trained versions (weight sync), and each version was evaluated
    served = query(st, "SELECT DISTINCT weight_version AS v FROM tito ORDER BY 1").to_pylist()
    assert [r["v"] for r in served][:2] == [0, 1]
    evals = query(st, "SELECT DISTINCT version FROM evals ORDER BY 1").to_pylist()
    assert [r["version"] for r in evals] == [0, 1, 2]
    # the trajectories export as flat rows of this model's token ids
    n = export_run(st, arch, str(tmp_path / f"{arch}.parquet"))
    assert n > 0 and (tmp_path / f"{arch}.parquet").stat().st_size > 0
