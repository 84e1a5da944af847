"""OpenAI completions and chat responses built from spliced updates, in SGLang's field layout."""

from __future__ import annotations

import time
from typing import Optional

from pdd_sglang.router.splice import SplicedUpdate, SpliceError


def finish_fields(meta: dict) -> tuple[Optional[str], object]:
    """SGLang's finish_reason dict as OpenAI's (finish_reason, matched_stop)."""
    reason = meta.get("finish_reason")
    if not isinstance(reason, dict):
        return None, None
    return reason.get("type"), reason.get("matched")


def usage(meta: dict) -> dict:
    prompt, completion = meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)
    cached = meta.get("cached_tokens")
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached} if cached is not None else None,
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }


class OpenAIStream:
    """Per-request state of an OpenAI answer: ids, created time, text sent so far."""

    def __init__(self, chat: bool, model: str, include_usage: bool = False, answer=None):
        self.chat = chat
        # A chat's tool-call and reasoning parsing (router/chat_answer.py), when it has any.
        self.answer = answer
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())
        self.id: Optional[str] = None
        self.sent_chars = 0  # of the answer's text, sent as deltas
        self.sent_role = False

    @property
    def object(self) -> str:
        if self.chat:
            return "chat.completion.chunk"
        return "text_completion"

    def _envelope(self, choices: list, obj: Optional[str] = None, **extra) -> dict:
        return {"id": self.id, "object": obj or self.object, "created": self.created,
                "model": self.model, "choices": choices, **extra}

    # ---- whole answers ------------------------------------------------------------------
    def response(self, final: SplicedUpdate) -> dict:
        self.id = final.meta.get("id")
        reason, matched = finish_fields(final.meta)
        if self.chat:
            message = {"role": "assistant", "content": final.text, "reasoning_content": None}
            if self.answer is not None:
                content, reasoning, calls, finish = self.answer.whole(
                    final.text, final.meta.get("finish_reason"))
                message.update(content=content, reasoning_content=reasoning, tool_calls=calls)
                reason, matched = finish_fields({"finish_reason": finish})
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason,
                      "matched_stop": matched}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": final.text, "logprobs": None, "finish_reason": reason,
                      "matched_stop": matched}
            obj = "text_completion"
        return self._envelope([choice], obj, usage=usage(final.meta),
                              metadata={"pdd": final.meta.get("pdd")})

    # ---- streamed chunks ----------------------------------------------------------------
    async def parsed_chunks(self, update: SplicedUpdate) -> list[dict]:
        """A chat's chunks when its answer is parsed: each text delta through SGLang's tool-call
        and reasoning parsers (router/chat_answer.py)."""
        delta = self._delta(update)
        out = []
        if not self.sent_role:
            self.sent_role = True
            out.append(self._chat_chunk({"reasoning_content": None, "role": "assistant",
                                         "content": ""}))
        reason, matched = finish_fields(update.meta) if update.finished else (None, None)
        for message in await self.answer.deltas(delta, update.meta, reason):
            out.append(self._chat_chunk(message))
        if update.finished:
            out.append(self._chat_chunk({"reasoning_content": None},
                                        self.answer.final_reason(reason), matched))
            if self.include_usage:
                out.append(self._envelope([], usage=usage(update.meta)))
        return out

    def _delta(self, update: SplicedUpdate) -> str:
        self.id = update.meta.get("id")
        if len(update.text) < self.sent_chars:
            # The splicer's text only grows (splice.py): a shorter one is a router bug, and the
            # client is told so, not sent the answer again.
            raise SpliceError(f"the answer's text shrank from {self.sent_chars} characters to "
                              f"{len(update.text)} after it was sent")
        delta = update.text[self.sent_chars:]
        self.sent_chars = len(update.text)
        return delta

    def chunks(self, update: SplicedUpdate) -> list[dict]:
        """The chunks one update turns into (text delta, then a finish chunk for chat)."""
        delta = self._delta(update)
        reason, matched = finish_fields(update.meta) if update.finished else (None, None)
        out = []
        if self.chat:
            if not self.sent_role:
                self.sent_role = True
                out.append(self._chat_chunk({"reasoning_content": None, "role": "assistant",
                                             "content": ""}))
            if delta:
                out.append(self._chat_chunk({"reasoning_content": None, "content": delta}))
            if update.finished:
                out.append(self._chat_chunk({"reasoning_content": None}, reason, matched))
        elif delta or update.finished:
            out.append(self._envelope([{"index": 0, "text": delta, "logprobs": None,
                                        "finish_reason": reason, "matched_stop": matched}],
                                      usage=None))
        if update.finished and self.include_usage:
            out.append(self._envelope([], usage=usage(update.meta)))
        return out

    def _chat_chunk(self, delta: dict, reason=None, matched=None) -> dict:
        return self._envelope([{"index": 0, "delta": delta, "logprobs": None,
                                "finish_reason": reason, "matched_stop": matched}])
