"""Resume a request after a server failed mid-answer: go on from the last token the client has.

With ``--retry-after-first-token`` a request whose stream breaks after the client got ``k``
tokens (main died after the handoff, say) is sent again as a continuation: prompt + those ``k``
tokens, ``max_new_tokens - k`` more, on a fresh placement. The client's stream goes on where it
stopped; nothing it has is repeated or changed. Greedy answers come out as the failed server
would have given them. With sampling the rest is a valid continuation, not the same draw; a stop
string that would have matched across the resume point is not seen.

Pure logic: :func:`continuation` makes the job, :class:`Resumed` maps the new attempt's updates
onto the client's stream.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from pdd_sglang.router.prompt import Prompt
from pdd_sglang.router.request_parsing import GenerateJob
from pdd_sglang.router.splice import SplicedUpdate


def continuation(job: GenerateJob, sent_ids: list[int]) -> Optional[GenerateJob]:
    """The job that produces the rest of ``job``'s answer after ``sent_ids``; None if nothing is
    left to produce. ``job``'s prompt must be exact (its ids: the continuation's prompt is them
    followed by the client's tokens)."""
    if not job.prompt.exact:
        raise ValueError("a continuation needs the prompt's token ids")
    remaining = job.max_new_tokens - len(sent_ids)
    if remaining <= 0:
        return None
    params = dict(job.sampling_params, max_new_tokens=remaining)
    if isinstance(params.get("min_new_tokens"), int):
        params["min_new_tokens"] = max(0, params["min_new_tokens"] - len(sent_ids))
    return dataclasses.replace(job, prompt=Prompt.of_ids(job.prompt.ids + tuple(sent_ids)),
                               sampling_params=params)


@dataclass
class Resumed:
    """The client's view of a continuation: what it already has, then the new attempt's tokens."""

    prompt_tokens: int  # the original prompt's length
    sent_ids: list[int]  # tokens the client has from the failed attempts
    sent_text: str
    decode: Callable[[list[int]], str]

    def update(self, update: SplicedUpdate) -> SplicedUpdate:
        ids = self.sent_ids + list(update.output_ids)
        meta = dict(update.meta)
        meta["prompt_tokens"] = self.prompt_tokens
        meta["completion_tokens"] = len(ids)
        meta["resumed_after_tokens"] = len(self.sent_ids)
        return dataclasses.replace(update, output_ids=ids,
                                   text=self.sent_text + self._tail(update, ids), meta=meta)

    def _tail(self, update: SplicedUpdate, ids: list[int]) -> str:
        """The new attempt's text as it reads after the client's text.

        Decoding the tokens on their own can lose what the tokenizer joins across the boundary
        (SentencePiece drops a leading space at the start of a sequence), so the tail is taken
        from a decode of the whole answer; any stop string the attempt trimmed stays trimmed.
        """
        base = self.decode(self.sent_ids)
        whole = self.decode(ids)
        if not whole.startswith(base):
            return update.text
        tail = whole[len(base):]
        trimmed = len(self.decode(list(update.output_ids))) - len(update.text)
        return tail[:len(tail) - trimmed] if trimmed > 0 else tail
