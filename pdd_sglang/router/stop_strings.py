"""What of a stream's text the client may have yet: never text it would have to take back.

SGLang keeps its own streams consistent in two steps, and the router does the same to the text
it sends:

- while a request runs, its scheduler streams nothing while the end of the text could be the
  start of a stop string (``Req.check_match_stop_str_prefix``), and its detokenizer streams no
  incomplete character (U+FFFD, ``find_printable_text``);
- when the request finishes, its detokenizer cuts the text at the matched stop string, or just
  after it with ``no_stop_trim`` (``DetokenizerManager.trim_matched_stop``).

The router needs its own copy of both because it sends text that no SGLang server held back or
trimmed: the relay's pdd_handoff chunk (a finish: SGLang flushes what it was holding back,
perhaps the first tokens of a stop string that main completes), and after a handoff or a lost
relay, main's tokens, which the router decodes itself (:mod:`pdd_sglang.router.splice`).

Both steps look only at the text the client does not have yet plus the last few characters (as
long as the longest stop string): O(stop strings' length) per chunk, whatever the answer's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pdd_sglang.router.detokenize import REPLACEMENT_CHAR


@dataclass(frozen=True)
class StopStrings:
    """One request's stop strings (SGLang's ``stop`` sampling parameter) and ``no_stop_trim``."""

    strings: tuple[str, ...] = ()
    no_stop_trim: bool = False
    # Where a stop string may start in a chunk's tail: at most this far back, on these characters.
    _longest: int = field(init=False, repr=False, compare=False)
    _first_chars: frozenset = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_longest", max(map(len, self.strings), default=0))
        object.__setattr__(self, "_first_chars", frozenset(s[0] for s in self.strings))

    @classmethod
    def of(cls, sampling_params: dict) -> "StopStrings":
        stop = sampling_params.get("stop")
        strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
        strings = tuple(s for s in strings if isinstance(s, str) and s)
        no_stop_trim = sampling_params.get("no_stop_trim") is True
        if not (strings or no_stop_trim):
            return _NONE  # most requests: one shared instance (it is frozen), none built
        return cls(strings, no_stop_trim)

    def sendable_end(self, text: str, sent: int) -> int:
        """How much of a running request's ``text`` the client may have (the client has
        ``text[:sent]``): all but a trailing incomplete character and a trailing part that a stop
        string may start with, or starts with (a stop the server has not finished on yet)."""
        end = len(text)
        while end > sent and text[end - 1] == REPLACEMENT_CHAR:
            end -= 1
        for start in range(max(sent, end - self._longest), end):
            if text[start] not in self._first_chars:
                continue
            tail = text[start:end]
            if any(s.startswith(tail) or tail.startswith(s) for s in self.strings):
                return start
        return end

    def final_end(self, text: str, sent: int, finish_reason: Optional[dict]) -> int:
        """Where a finished request's ``text`` ends for the client: at the matched stop string, or
        just after it with ``no_stop_trim``, as SGLang cuts it; never before ``sent``."""
        matched = finish_reason.get("matched") if isinstance(finish_reason, dict) else None
        if not isinstance(matched, str) or not matched:
            return len(text)  # no stop string (a stop token, a length limit): nothing to cut
        # SGLang cuts at the first occurrence; one wholly sent already can only be text the
        # server did not stop on, so the search starts where an unsent one could.
        at = text.find(matched, max(0, sent - len(matched) + 1))
        if at == -1:
            return len(text)
        return max(sent, at + len(matched) if self.no_stop_trim else at)


_NONE = StopStrings()
