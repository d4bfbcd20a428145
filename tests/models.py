"""The micro models the training tests build their models from (2 layers, hidden 32).

Smaller than the tiny model the runs use (infra/engine/tiny_model.py), so that fp64
exactness checks over hundreds of random trees stay fast. One per supported architecture
family, each with what sets it apart from the others: Qwen3 has q/k RMSNorms and an untied
head; Llama (SmolLM2's architecture) has neither q/k norms nor an explicit ``head_dim``
(hidden / heads) and ties the head to the embedding; Qwen2 has q/k/v biases.
Tests parametrize over ``ARCHS`` with ``micro_config(arch, vocab)``.
"""

from __future__ import annotations

from pathlib import Path

from transformers import LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from infra.engine.tiny_model import ARCHS  # noqa: F401  (the families, as the tiny models)

_SHAPE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def micro_qwen3_config(vocab_size: int) -> Qwen3Config:
    return Qwen3Config(vocab_size=vocab_size, head_dim=8, tie_word_embeddings=False, **_SHAPE)


def micro_llama_config(vocab_size: int) -> LlamaConfig:
    """SmolLM2-135M's layout in miniature: 3 query heads per KV head (its 9 / 3), head_dim
    implied (48 / 6 = 8), tied embeddings, rope_theta 1e5."""
    shape = _SHAPE | {"hidden_size": 48, "intermediate_size": 96, "num_attention_heads": 6}
    return LlamaConfig(
        vocab_size=vocab_size, tie_word_embeddings=True, rope_theta=100_000.0, **shape
    )


def micro_qwen2_config(vocab_size: int) -> Qwen2Config:
    return Qwen2Config(vocab_size=vocab_size, tie_word_embeddings=False, **_SHAPE)


def micro_config(arch: str, vocab_size: int) -> PretrainedConfig:
    return {"qwen3": micro_qwen3_config, "llama": micro_llama_config, "qwen2": micro_qwen2_config}[
        arch
    ](vocab_size)


def save_beside_tokenizer(model, src: str | Path, out: Path) -> str:
    """Save ``model`` to ``out`` with the tokenizer, chat template and generation files of
    checkpoint ``src``: a changed model that still talks with ``src``'s tokenizer."""
    model.save_pretrained(out)
    for f in Path(src).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation")):
            (out / f.name).write_bytes(f.read_bytes())
    return str(out)
