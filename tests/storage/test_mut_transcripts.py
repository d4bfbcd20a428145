"""storage/transcripts.py's list of the tokens a tokenizer_config.json names, pinned where
generated mutants survived its other fast tests (bench/mutation.py): every key that can
name a token, and added tokens written as dicts (``{"content": ...}``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from storage.transcripts import _named_tokens, load_decoder, plain_backend
from tests.storage.test_transcripts_decoder import _copy_tokenizer


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


def test_a_checkpoint_transformers_would_change_decodes_with_transformers(tmp_path):
    """Not the plain case (a class that rebuilds the backend): ``load_decoder`` hands back
    the checkpoint's own transformers tokenizer, which decodes as loading it by hand does."""
    from transformers import AutoTokenizer  # a cold import: only this test needs it

    path = _copy_tokenizer(tmp_path, tokenizer_class="Qwen2Tokenizer")
    assert plain_backend(path) is None
    got, ref = load_decoder(path), AutoTokenizer.from_pretrained(path)
    assert type(got) is type(ref)
    ids = list(range(0, len(ref), 7))
    assert got.decode(ids) == ref.decode(ids)


_READ_UNDER_C = """
import sys
from storage.transcripts import plain_backend
print("plain" if plain_backend(sys.argv[1]) is not None else "none")
"""


def test_the_tokenizer_config_is_read_as_utf8_whatever_the_locale(tmp_path):
    """A config with non-ASCII text (a chat template, a token's name) read on a machine whose
    locale is not UTF-8 (C, no UTF-8 mode, no coercion: Python's locale encoding is ASCII)
    still takes the light path; read in the locale's encoding it would fail to decode and
    fall back to transformers."""
    path = _copy_tokenizer(tmp_path, chat_template="{# réponse — 回答 #}{{ messages }}")
    raw = (Path(path) / "tokenizer_config.json").read_text()
    (Path(path) / "tokenizer_config.json").write_text(raw.replace("\\u00e9", "é"), "utf-8")
    assert "é" in (Path(path) / "tokenizer_config.json").read_text("utf-8")
    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG"))}
    env |= {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "PYTHONPATH": root}
    probe = "import locale; print(locale.getpreferredencoding(False))"
    enc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert enc.stdout.strip().lower() in ("ansi_x3.4-1968", "ascii", "us-ascii"), enc.stdout
    out = subprocess.run(
        [sys.executable, "-c", _READ_UNDER_C, path],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "plain"
