"""The micro Qwen3 the training tests build their models from (2 layers, hidden 32).

Smaller than the tiny model the runs use (infra/engine/tiny_model.py), so that fp64
exactness checks over hundreds of random trees stay fast.
"""

from __future__ import annotations

from transformers import Qwen3Config


def micro_qwen3_config(vocab_size: int) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
