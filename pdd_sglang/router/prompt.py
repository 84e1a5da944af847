"""A request's prompt as the router carries it: the client's text, or the client's token ids.

The router tokenizes no prompt on its hot path. A text prompt goes to every server as text, and
each SGLang server tokenizes it itself, identically (the same tokenizer, SGLang's default
``add_special_tokens``), as SGLang's own PD router leaves them to. Placement needs token counts
(main's cached prefix, the WAN bytes of the uncached suffix, the TTFT budget), so for text they
are estimated from the text's UTF-8 length (:class:`TokenEstimate`); each answer's exact
``prompt_tokens`` corrects the estimate, and ``meta_info.pdd.estimated_prompt_tokens`` says how
far off it was. Counts that must be exact stay exact:

- the context-length refusal: a text whose token count could reach the limit (:meth:`
  TokenEstimate.bound`, which no tokenizer exceeds) is tokenized, and sent as ids;
- requests that bring ``input_ids`` keep them, exact;
- a retry that resends the prompt plus the client's tokens tokenizes the text then (rare).

Prefix matches (the mirror, the landing copies) run over :attr:`Prompt.key`: the text itself
(characters, as sglang-router's cache-aware tree does) or the tuple of ids; a length in key
units converts to tokens in proportion (:meth:`Prompt.tokens_of`).

Owner of the estimate (:class:`TokenEstimate`, one per router process): the router's event loop;
parsing reads it, the finish recorder teaches it. A Prompt is immutable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

# Tokens beyond one per UTF-8 byte that a tokenizer may add to a text (a SentencePiece dummy
# prefix, digits split apart): the bound's margin over bytes + special tokens.
BOUND_MARGIN_TOKENS = 8
# The estimate learns from each answer by this much (an exponential average over ~32 answers).
LEARNING_RATE = 1 / 32
# A typical English text's tokens per byte, until the servers' counts say otherwise.
DEFAULT_TOKENS_PER_BYTE = 0.25

Key = Union[str, tuple]


def as_key(sequence) -> Key:
    """A text stays text; token ids become a tuple (a list never compares equal to a tuple, and
    keys are compared by slices)."""
    return sequence if isinstance(sequence, (str, tuple)) else tuple(sequence)


def utf8_length(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "replace"))


@dataclass
class TokenEstimate:
    """Tokens per UTF-8 byte of text prompts, learnt from the servers' exact counts.

    ``specials``: the tokens the tokenizer adds to any text (a BOS). Owner: the router's event
    loop (parsing reads it, the finish recorder teaches it)."""

    tokens_per_byte: float = DEFAULT_TOKENS_PER_BYTE
    specials: int = 0

    def tokens(self, text: str) -> int:
        return self.specials + max(1, round(utf8_length(text) * self.tokens_per_byte))

    def bound(self, text: str) -> int:
        """At least the text's token count with any tokenizer: a token covers at least one byte
        (byte-level BPE, SentencePiece's byte fallback), plus what a tokenizer adds."""
        return utf8_length(text) + self.specials + BOUND_MARGIN_TOKENS

    def observe(self, text: str, actual_tokens: int) -> None:
        length = utf8_length(text)
        if length <= 0 or actual_tokens <= self.specials:
            return
        sample = (actual_tokens - self.specials) / length
        self.tokens_per_byte += (sample - self.tokens_per_byte) * LEARNING_RATE


@dataclass(frozen=True)
class Prompt:
    """``text`` (tokens estimated) or ``ids`` (exact); ``tokens`` is the count either way."""

    tokens: int
    text: Optional[str] = None
    ids: Optional[tuple] = None
    _key: Key = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_key", self.text if self.ids is None else self.ids)

    @classmethod
    def of_ids(cls, ids: Sequence[int]) -> "Prompt":
        ids = tuple(ids)
        return cls(len(ids), ids=ids)

    @classmethod
    def of_text(cls, text: str, estimate: TokenEstimate) -> "Prompt":
        return cls(estimate.tokens(text), text=text)

    @property
    def exact(self) -> bool:
        return self.ids is not None

    @property
    def key(self) -> Key:
        """What prefix matches run over: the text, or the tuple of ids."""
        return self._key

    def tokens_of(self, key_length: int) -> int:
        """The tokens in the first ``key_length`` units of :attr:`key`."""
        if self.ids is not None or key_length <= 0:
            return max(0, key_length)
        return min(self.tokens, round(self.tokens * key_length / max(1, len(self.text))))

    def key_length_of(self, tokens: int) -> int:
        """The units of :attr:`key` that ``tokens`` of it take (the inverse of tokens_of)."""
        if self.ids is not None:
            return tokens
        return min(len(self.text), round(len(self.text) * tokens / max(1, self.tokens)))

    def body_fields(self) -> dict:
        """The prompt's part of a /generate body."""
        return {"text": self.text} if self.ids is None else {"input_ids": list(self.ids)}
