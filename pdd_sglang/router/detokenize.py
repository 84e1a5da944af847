"""Incremental detokenization: the text of a growing token list at O(new tokens) per step.

Decoding every token again on each chunk makes an N-token answer cost O(N^2) token decodes. This
decodes a small window instead, the way SGLang's detokenizer manager and vLLM's
``detokenize_incrementally`` do, so it stays exact for tokenizers whose decode is not
prefix-stable (SentencePiece's leading-space rule, byte-level BPE whose multi-byte characters are
split across tokens):

- ``prefix_offset`` .. ``read_offset``: a few tokens already turned into text, decoded again as
  context, so a token whose text depends on its left neighbour decodes as it does in the whole;
- a step decodes ``ids[prefix_offset:]`` and emits what it adds beyond the context's text, but
  only once that text is stable: not ending in U+FFFD (an incomplete UTF-8 sequence that the next
  token completes). Until then nothing is emitted and the window grows by the new tokens.
- the last step (``final``) emits whatever is there, U+FFFD included, as a whole decode would.
"""

from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5  # tokens of already-emitted text decoded again as context (vLLM uses 5)
MAX_BACKOFF_TOKENS = 8  # how far start() looks back for a stable point


class IncrementalDetokenizer:
    """Appends the text of ``ids[read_offset:]`` step by step; one instance per stream."""

    def __init__(self, decode: Callable[[Sequence[int]], str], read_offset: int = 0):
        self._decode = decode
        self.read_offset = read_offset
        self.prefix_offset = max(0, read_offset - CONTEXT_TOKENS)
        self._prefix_text: str | None = None  # decode(ids[prefix_offset:read_offset]), cached

    @classmethod
    def start(cls, decode: Callable[[Sequence[int]], str],
              ids: Sequence[int]) -> tuple["IncrementalDetokenizer", str]:
        """A detokenizer for text that already covers ``ids``, and the text of ``ids`` it counts
        from: the longest prefix (at most MAX_BACKOFF_TOKENS shorter) whose decode is stable.

        One full decode, once per stream (at a handoff): a character that the relay's last
        tokens left incomplete is completed by main's first ones.
        """
        end = len(ids)
        text = decode(list(ids))
        floor = max(0, end - MAX_BACKOFF_TOKENS)
        while end > floor and text.endswith(REPLACEMENT_CHAR):
            end -= 1
            text = decode(list(ids[:end]))
        return cls(decode, end), text

    def step(self, ids: Sequence[int], final: bool = False) -> str:
        """The text that ``ids`` (the whole list so far) adds; '' while it is not stable."""
        if len(ids) <= self.read_offset:
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(list(ids[self.prefix_offset:self.read_offset]))
        new_text = self._decode(list(ids[self.prefix_offset:]))
        if not final and (new_text.endswith(REPLACEMENT_CHAR)
                          or len(new_text) <= len(self._prefix_text)):
            return ""
        delta = new_text[len(self._prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        self._prefix_text = None
        return delta
