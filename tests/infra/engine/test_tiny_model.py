import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from infra.engine.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def test_checkpoint_files_and_config(model_dir):
    names = set(os.listdir(model_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    cfg = json.loads(Path(model_dir, "config.json").read_text())
    assert cfg["model_type"] == "qwen3"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"]) == (64, 2, 2)
    assert cfg["max_position_embeddings"] >= 16384
    assert cfg["tie_word_embeddings"] is True


def test_loads_offline_with_auto_classes(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert 900 <= len(tok) <= 1100
    assert model.config.vocab_size == len(tok)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for special in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>"]:
        assert len(tok.encode(special, add_special_tokens=False)) == 1, special
    text = "def add(a, b):\n    return a + b  # héllo ✓"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode("hello world")])).logits
    assert logits.shape[-1] == len(tok) and torch.isfinite(logits).all()


def test_deterministic_per_seed_and_reused(tmp_path, model_dir):
    again = make_tiny_model(tmp_path / "again", seed=0)
    other = make_tiny_model(tmp_path / "other", seed=1)
    a = load_file(os.path.join(model_dir, "model.safetensors"))
    b = load_file(os.path.join(again, "model.safetensors"))
    c = load_file(os.path.join(other, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    tok_a = Path(model_dir, "tokenizer.json").read_text()
    assert tok_a == Path(again, "tokenizer.json").read_text()
    mtime = os.path.getmtime(os.path.join(again, "model.safetensors"))
    assert make_tiny_model(again) == str(again)  # complete: returned without rebuilding
    assert os.path.getmtime(os.path.join(again, "model.safetensors")) == mtime


def test_default_dir_uses_gyre_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_CACHE", str(tmp_path))
    path = make_tiny_model(seed=3)
    assert path == str(tmp_path / "models" / "tiny-qwen3-s3")
    assert not [p for p in os.listdir(tmp_path / "models") if p.startswith(".")]  # no temp left


MESSAGES = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "What is 2+2?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "calc", "arguments": {"expr": "2+2"}}}
        ],
    },
    {"role": "tool", "content": "4"},
    {"role": "assistant", "content": "The answer is 4."},
    {"role": "user", "content": "Thanks"},
]
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


def test_chat_template_renders_qwen_style(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(MESSAGES[1:3], tokenize=False, add_generation_prompt=False)
    assert text == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "calc", "arguments": {"expr": "2+2"}}\n</tool_call><|im_end|>\n'
    )
    with_tools = tok.apply_chat_template(MESSAGES[:2], tools=TOOLS, tokenize=False)
    assert with_tools.startswith("<|im_start|>system\nYou are helpful.\n\n# Tools")
    assert '<tools>\n{"type": "function", "function": {"name": "calc"' in with_tools
    assert with_tools.count("<|im_start|>system") == 1
    gen = tok.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    assert gen.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_is_prefix_stable(model_dir, tools):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    for k in range(1, len(MESSAGES)):
        short = tok.apply_chat_template(MESSAGES[:k], tools=tools, tokenize=False)
        longer = tok.apply_chat_template(MESSAGES[: k + 1], tools=tools, tokenize=False)
        assert longer.startswith(short), k
        if MESSAGES[k]["role"] == "assistant":
            prompt = tok.apply_chat_template(
                MESSAGES[:k], tools=tools, tokenize=False, add_generation_prompt=True
            )
            assert longer.startswith(prompt), k


def test_older_build_is_rebuilt(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    marker = Path(path, ".gyre-complete")
    marker.write_text(json.dumps({"seed": 0}))  # what the first recipe wrote
    (Path(path) / "model.safetensors").write_bytes(b"stale")
    assert make_tiny_model(path) == path
    assert load_file(os.path.join(path, "model.safetensors"))  # rebuilt, loadable
    assert json.loads(marker.read_text())["format"] >= 2


@pytest.mark.parametrize(
    ("arch", "cls", "only_here", "absent"),
    [
        ("llama", "LlamaForCausalLM", None, "self_attn.q_norm.weight"),
        ("qwen2", "Qwen2ForCausalLM", "self_attn.q_proj.bias", "self_attn.q_norm.weight"),
    ],
)
def test_other_architectures_load_completely(tmp_path, model_dir, arch, cls, only_here, absent):
    """The same tiny model in the Llama (SmolLM2) and Qwen2 families: every weight the
    architecture has is in the file (none left to random init), none it lacks; same tokenizer."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / arch, seed=0, arch=arch)
    cfg = json.loads(Path(path, "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["architectures"] == [cls]
    tok = json.loads(Path(model_dir, "tokenizer.json").read_text())
    vocab = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert cfg["tie_word_embeddings"] is True and cfg["bos_token_id"] is None
    assert (cfg["eos_token_id"], cfg["pad_token_id"]) == (
        vocab["<|im_end|>"],
        vocab["<|endoftext|>"],
    )
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert type(model).__name__ == cls
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    names = load_file(os.path.join(path, "model.safetensors")).keys()
    assert not any(n.endswith(absent) for n in names)
    assert only_here is None or any(n.endswith(only_here) for n in names)
    assert Path(path, "tokenizer.json").read_text() == Path(model_dir, "tokenizer.json").read_text()
    assert make_tiny_model(path, arch="qwen3") == path  # another arch's build is rebuilt
    assert json.loads(Path(path, "config.json").read_text())["model_type"] == "qwen3"
    with pytest.raises(ValueError, match="arch="):
        make_tiny_model(tmp_path / "x", arch="gpt2")
