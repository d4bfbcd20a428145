"""Incremental detokenization for streaming: decode only the new tokens, not the whole output.

Re-decoding every output token on each streamed chunk costs O(n²) in the output length. As
vLLM's and SGLang's incremental detokenizers do, `IncrementalDetokenizer` keeps the text already
settled and two offsets into the ids: ``surr`` (start of a small overlap window) and ``read``
(ids before it are settled). Each update decodes ``ids[surr:]`` and ``ids[surr:read]`` and
appends the difference: decoding with a few tokens of left context gives the same
continuation as decoding from the start (byte-level merges, leading-space handling), without
the cost. While the window's text ends in U+FFFD, its last token may be the start of a UTF-8
character whose other bytes are still to come, so nothing is settled until it resolves.

The settled text is always a prefix of ``tokenizer.decode(ids)``; the streamer's last chunk
uses one full decode, so the final text is exactly a non-streamed call's.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Settled text of a growing list of output ids, for one request."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""  # decode(ids[:read]), built piece by piece
        self.surr = 0  # start of the overlap window
        self.read = 0  # ids[:read] are settled in `text`

    def update(self, ids: list[int]) -> str:
        """Settle what `ids` (the whole output so far, extending the last call's) allow."""
        if len(ids) > self.read:
            before = self.tokenizer.decode(ids[self.surr : self.read])
            after = self.tokenizer.decode(ids[self.surr :])
            if not after.endswith(REPLACEMENT) and after.startswith(before):
                self.text += after[len(before) :]
                self.surr, self.read = self.read, len(ids)
        return self.text
