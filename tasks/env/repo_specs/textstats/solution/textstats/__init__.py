from textstats.counts import sentence_count, top_words, word_count, words

__all__ = ["sentence_count", "top_words", "word_count", "words"]
