import re
from collections import Counter

_WORD = re.compile(r"[A-Za-z0-9']+")
_END = re.compile(r"[.!?]+")


def words(text):
    return [w.lower() for w in _WORD.findall(text)]


def word_count(text):
    return len(words(text))


def top_words(text, n):
    if n < 0:
        raise ValueError("n must be at least 0")
    counts = Counter(words(text))
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return ranked[:n]


def sentence_count(text):
    parts = _END.split(text)
    n = len(parts) - 1
    if words(parts[-1]):
        n += 1
    return n
