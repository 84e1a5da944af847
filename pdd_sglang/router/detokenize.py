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

:class:`StreamDetokenizer` does the same on the tokenizers library's own ``DecodeStream`` (Rust,
about a microsecond a token against fifteen for two decodes through transformers a step), where
the tokenizer is a tokenizers one whose decode adds no Python clean-up
(:func:`detokenizer_for`); IncrementalDetokenizer serves any other.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional, Sequence

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


class StreamDetokenizer:
    """IncrementalDetokenizer's steps on ``tokenizers.decoders.DecodeStream``."""

    def __init__(self, backend: Any, skip_special_tokens: bool,
                 decode: Callable[[Sequence[int]], str], read_offset: int):
        from tokenizers.decoders import DecodeStream

        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._backend, self._decode = backend, decode
        self.read_offset = read_offset
        self._emitted_through = read_offset  # every token before it is in the text emitted

    @classmethod
    def start(cls, backend: Any, skip_special_tokens: bool,
              decode: Callable[[Sequence[int]], str],
              ids: Sequence[int]) -> tuple["StreamDetokenizer", str]:
        """As IncrementalDetokenizer.start (its stable point), the stream primed with the ids
        before it."""
        stable, text = IncrementalDetokenizer.start(decode, ids)
        detok = cls(backend, skip_special_tokens, decode, stable.read_offset)
        for token in ids[:stable.read_offset]:
            detok._stream.step(backend, token)
        return detok, text

    def step(self, ids: Sequence[int], final: bool = False) -> str:
        end, index = len(ids), self.read_offset
        if end == index + 1:  # a token a chunk, the usual stream: no list to join
            text = self._stream.step(self._backend, ids[index]) or ""
            if text:
                self._emitted_through = end
        else:
            pieces = []
            for index in range(index, end):
                piece = self._stream.step(self._backend, ids[index])
                if piece:
                    pieces.append(piece)
                    self._emitted_through = index + 1
            text = "".join(pieces)
        self.read_offset = end
        if final and self._emitted_through < end:
            # The answer ends inside a character: what a whole decode shows of it (U+FFFD).
            context = max(0, self._emitted_through - CONTEXT_TOKENS)
            head = self._decode(list(ids[context:self._emitted_through]))
            text += self._decode(list(ids[context:]))[len(head):]
            self._emitted_through = end
        return text


def detokenizer_for(tokenizer: Any, skip_special_tokens: bool) -> Optional[Callable]:
    """``start(decode, ids)`` for a StreamDetokenizer when ``tokenizer`` is a tokenizers one
    whose decode adds no clean-up; None (IncrementalDetokenizer) otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401 - tokenizers >= 0.21
    except ImportError:
        return None
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces",
                                                     False):
        return None
    return partial(StreamDetokenizer.start, backend, skip_special_tokens)
