"""storage/transcripts.py's list of the tokens a tokenizer_config.json names, pinned where
generated mutants survived its other fast tests (bench/mutation.py): every key that can
name a token, and added tokens written as dicts (``{"content": ...}``)."""

from __future__ import annotations

from storage.transcripts import _named_tokens


def test_every_way_a_config_names_a_token_is_read():
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "lstrip": False},
        "pad_token": None,
        "model_max_length": 2048,
        "additional_special_tokens": ["<tool>", {"content": "<think>"}],
        "added_tokens_decoder": {"5": {"content": "<im_start>", "special": True}},
    }
    assert _named_tokens(config) == {"<s>", "</s>", "<tool>", "<think>", "<im_start>"}


def test_extra_special_tokens_as_a_dict_come_first():
    config = {"extra_special_tokens": {"image": "<img>"}, "additional_special_tokens": ["<x>"]}
    assert _named_tokens(config) == {"<img>"}
    assert _named_tokens({"extra_special_tokens": [], "additional_special_tokens": ["<x>"]}) == {
        "<x>"
    }
