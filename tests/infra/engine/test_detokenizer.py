"""Incremental detokenization: settled text is always a prefix of the full decode, and equals it
once the output does not end inside a UTF-8 character."""

import random

import pytest

from infra.engine.detokenizer import IncrementalDetokenizer
from infra.engine.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tiny_model())


def byte_char(b: int) -> str:
    """GPT-2's byte-to-unicode map: the character a byte-level BPE vocab uses for byte `b`."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def byte_token(tok, b: int) -> int:
    """Id of the byte-level token of the single byte `b`."""
    tid = tok.convert_tokens_to_ids(byte_char(b))
    assert tid is not None and tid != tok.unk_token_id, b
    return tid


def stream(tok, ids, rng):
    """Feed `ids` in random-sized chunks; the texts a streamer would send."""
    detok, texts, n = IncrementalDetokenizer(tok), [], 0
    while n < len(ids):
        n = min(len(ids), n + rng.randint(1, 4))
        texts.append(detok.update(ids[:n]))
    return texts


def check(tok, ids, rng):
    texts = stream(tok, ids, rng)
    full = tok.decode(ids)
    for a, b in zip(texts, [*texts[1:], full], strict=True):
        assert b.startswith(a), (ids, a, b)
    if not full.endswith("\ufffd"):
        assert texts[-1] == full, ids


def test_split_utf8_characters_are_held_then_settled(tok):
    euro = [byte_token(tok, b) for b in "€".encode()]  # 3 byte tokens
    head = tok.encode("price: ")
    ids = head + euro + tok.encode(" ok")
    detok = IncrementalDetokenizer(tok)
    assert detok.update(head) == "price: "
    for k in (1, 2):  # inside the character: nothing new is settled
        assert tok.decode(ids[: len(head) + k]).endswith("\ufffd")
        assert detok.update(ids[: len(head) + k]) == "price: "
    assert detok.update(ids) == tok.decode(ids) == "price: € ok"


def test_random_outputs_stream_to_the_full_decode(tok):
    rng = random.Random(0)
    emoji = [byte_token(tok, b) for b in "🙂é".encode()]
    for _ in range(200):
        ids = []
        while len(ids) < rng.randint(1, 60):
            r = rng.random()
            if r < 0.3:
                ids.append(byte_token(tok, rng.randint(0x80, 0xFF)))  # lone / broken bytes
            elif r < 0.4:
                ids.extend(emoji)
            else:
                ids.append(rng.randrange(len(tok)))  # any token, special ones included
        check(tok, ids, rng)
