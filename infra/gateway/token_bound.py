"""A lower bound on a text's token count from its length alone, before tokenizing it.

Tokenizing is the gateway's dearest step (a 10 MB body is ~6M tokens and a minute of CPU on a
busy machine), and a text that cannot fit the model's context need not be tokenized to be
refused: for a byte-pair tokenizer that drops nothing,

    tokens(text) >= len(text) / (factor * cap)

where ``cap`` is the longest token of the vocabulary (added tokens included) in characters
and ``factor`` is how much the normalizer can shrink a text (in characters).

Why it holds: BPE (no unknown token fused over a run) cuts the normalized, pre-tokenized text
into vocabulary entries that concatenate back to it, so ``tokens * cap`` >= that text's length.
The pre-tokenizers allowed here keep every character (ByteLevel maps each UTF-8 byte to one
character: the length only grows; Metaspace swaps a space for "▁"; the splitting ones isolate
or merge pieces but never remove them), and an added token matched in the raw text is one
token of at most ``cap`` characters (none that strips the whitespace around it is allowed).
Normalizers: none, decompositions and lowercasing only lengthen a text (factor 1); NFC/NFKC
compose at most three characters into one (Hangul L+V+T jamo, halfwidth ones under NFKC:
factor 3). Anything else (a normalizer or pre-tokenizer that may drop text, WordPiece's or
Unigram's unknown tokens, a fused unknown) gives no bound: ``None``, and the text is simply
tokenized (off the event loop).

Pure module: no tokenizer import (it reads the tokenizer's JSON config).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["chars_per_token_cap", "min_tokens"]

_KEEPING_PRE = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}
_LENGTHENING_NORM = {"NFD", "NFKD", "Lowercase", "Prepend"}
_COMPOSING_NORM = {"NFC", "NFKC"}


def _norm_factor(norm: dict | None) -> int | None:
    """How many characters the normalizer may fold into one; None when it may drop text."""
    if norm is None:
        return 1
    kind = norm.get("type")
    if kind == "Sequence":
        out = 1
        for part in norm.get("normalizers") or []:
            f = _norm_factor(part)
            if f is None:
                return None
            out *= f
        return out
    if kind in _LENGTHENING_NORM:
        return 1
    if kind in _COMPOSING_NORM:
        return 3
    if kind == "Replace":  # a plain string replaced by one at least as long (" " -> "▁")
        pat = (norm.get("pattern") or {}).get("String")
        content = norm.get("content")
        if isinstance(pat, str) and pat and isinstance(content, str):
            return 1 if len(content) >= len(pat) else None
    return None


def _keeps_text(pre: dict | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers") or [])
    return kind in _KEEPING_PRE and pre.get("behavior") != "Removed"


def chars_per_token_cap(config: dict[str, Any], vocab: Iterable[str]) -> int | None:
    """``factor * cap`` of the module doc for a tokenizer (its ``tokenizer.json`` as parsed,
    and its vocabulary's token strings, added tokens included), or None (no bound)."""
    model = config.get("model") or {}
    if model.get("type") != "BPE":
        return None
    if model.get("unk_token") is not None and model.get("fuse_unk"):
        return None  # one unknown token may stand for a run of any length
    if any(t.get("lstrip") or t.get("rstrip") for t in config.get("added_tokens") or []):
        return None  # such a token swallows the whitespace beside it, however long
    if not _keeps_text(config.get("pre_tokenizer")):
        return None
    factor = _norm_factor(config.get("normalizer"))
    cap = max((len(s) for s in vocab), default=0)
    if factor is None or cap <= 0:
        return None
    return factor * cap


def min_tokens(text: str, cap: int | None) -> int:
    """At least this many tokens encode ``text`` (0 when the tokenizer gives no bound)."""
    return -(-len(text) // cap) if cap else 0
