"""The token-count lower bound the gateway refuses over-long inputs with, before tokenizing."""

from __future__ import annotations

import time

import pytest

from infra.engine.tiny_model import make_tiny_model
from infra.gateway.chat import ChatTokenizer, ContextTooLong
from infra.gateway.token_bound import chars_per_token_cap, min_tokens

BPE = {"type": "BPE", "unk_token": None, "fuse_unk": False}
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False}
VOCAB = ["a", "b", "ab", "abab", "<|im_end|>"]  # longest: 10 characters


def _cfg(**kw) -> dict:
    return {"model": BPE, "pre_tokenizer": BYTE_LEVEL, "normalizer": None, **kw}


def test_cap_is_the_longest_token_times_what_the_normalizer_can_fold():
    assert chars_per_token_cap(_cfg(), VOCAB) == 10
    assert chars_per_token_cap(_cfg(normalizer={"type": "NFC"}), VOCAB) == 30  # Hangul LVT
    seq = {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]}
    assert chars_per_token_cap(_cfg(normalizer=seq), VOCAB) == 30
    space = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    assert chars_per_token_cap(_cfg(normalizer=space), VOCAB) == 10
    split = {"type": "Split", "behavior": "Isolated", "pattern": {"Regex": "\\d"}}
    pre = {"type": "Sequence", "pretokenizers": [split, BYTE_LEVEL]}
    assert chars_per_token_cap(_cfg(pre_tokenizer=pre), VOCAB) == 10


@pytest.mark.parametrize(
    "cfg",
    [
        _cfg(pre_tokenizer={"type": "Whitespace"}),  # drops whitespace: any run, no token
        _cfg(pre_tokenizer={"type": "Split", "behavior": "Removed", "pattern": {}}),
        _cfg(normalizer={"type": "Strip", "strip_left": True, "strip_right": True}),
        _cfg(normalizer={"type": "Replace", "pattern": {"Regex": " +"}, "content": " "}),
        _cfg(model={"type": "WordPiece", "unk_token": "[UNK]"}),  # a long word: one [UNK]
        _cfg(model={**BPE, "unk_token": "<unk>", "fuse_unk": True}),
        _cfg(added_tokens=[{"content": "<mask>", "lstrip": True, "rstrip": False}]),
    ],
)
def test_no_bound_where_a_token_can_stand_for_any_length(cfg):
    assert chars_per_token_cap(cfg, VOCAB) is None


def test_min_tokens_is_the_ceiling_of_length_over_cap():
    assert min_tokens("abcdefg", 3) == 3
    assert min_tokens("abcdef", 3) == 2
    assert min_tokens("", 3) == 0
    assert min_tokens("abc" * 100, None) == 0  # no bound: nothing claimed


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer(make_tiny_model())


def test_the_tiny_tokenizer_has_a_bound_and_keeps_it(tok):
    assert tok.token_cap == 13  # its longest token (in characters); byte-level BPE, no normalizer
    texts = [
        " " * 3000,
        "word " * 2000,
        "\n\n\t" * 500 + "<|im_end|>" * 50,
        "äöü漢字\U0001f600" * 300,
        "".join(chr(i) for i in range(32, 3000)),
    ]
    for t in texts:
        assert len(tok.encode(t)) >= min_tokens(t, tok.token_cap)


def test_a_long_text_is_tokenized_to_the_same_ids(tok):
    text = "the gateway never blocks: " * 2000  # over BIG_TEXT: the GIL-free path
    assert tok.encode(text) == tok.backend.encode(text, add_special_tokens=False).ids


def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenized(tok):
    text = "word " * 2_000_000  # 10 MB; tokenizing it takes seconds
    t0 = time.perf_counter()
    with pytest.raises(ContextTooLong) as err:
        tok.encode(text, limit=32768)
    assert time.perf_counter() - t0 < 0.1
    assert err.value.at_least == 10_000_000 // 13 + 1
    with pytest.raises(ContextTooLong) as err:
        tok.encode("word " * 10, limit=100, known=97)  # 50 characters: >= 4 tokens
    assert err.value.at_least == 101
    want = tok.backend.encode("word " * 10, add_special_tokens=False).ids
    assert tok.encode("word " * 10, limit=100, known=90) == want  # may fit (>= 4): tokenized
