"""A chat completion request turned into the /generate request SGLang's own server would run.

The router asks a prefill (``POST /pdd/chat_request``, :mod:`pdd_sglang.prefill.chat_request`),
which runs SGLang's own chat translation with the server's template, tokenizer and flags and
answers the prompt's token ids, the sampling parameters and the other /generate fields. Rather
than SGLang's serving code in the router: that code needs SGLang's runtime configuration, the
model's config and templates, torch, and a tokenizer manager stand-in, and it would render and
tokenize every conversation on the router's event loop (about 1.2 ms of CPU for a short chat
with one tool on the test model, more with a long history); the prefill's HTTP process does
that work for a plain SGLang server anyway, and the router then sends its prompt as ids, so no
server tokenizes it again. Placement and the prefix mirror see the exact ids.

A refusal by SGLang (its validation, its template, its context checks) reaches the client with
SGLang's own status and body. Owner: the router's event loop.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import orjson

from pdd_sglang.router.chat_fields import check_fields
from pdd_sglang.router.errors import RequestRejected
from pdd_sglang.router.model import ModelInfo
from pdd_sglang.router.prompt import Prompt
from pdd_sglang.router.request_parsing import (GenerateJob, _check_context, _ttft_slo_s,
                                               check_model, text_prompt)
from pdd_sglang.router.servers import PREFILL, NoHealthyServer, ServerPool

ROUTE = "/pdd/chat_request"
# Body fields that are the router's, not SGLang's chat request's.
_ROUTER_FIELDS = ("ttft_slo_ms",)


@dataclass
class ChatIntake:
    """A chat request past the router's own checks, before its translation."""

    body: dict
    model_name: str

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class ChatJob:
    job: GenerateJob
    model_name: str
    answer: dict  # the answer's parsing context (prefill/chat_request.py's answer_context)


def parse_chat(body: dict, model: ModelInfo) -> ChatIntake:
    """What the router checks itself: the model's name, the fields it cannot honour."""
    name = check_model(body, model)
    check_fields(body)
    _ttft_slo_s(body)
    return ChatIntake(body, name)


class ChatTranslator:
    def __init__(self, pool: ServerPool, client, model: ModelInfo):
        self.pool, self.client, self.model = pool, client, model
        self._turn = itertools.count()

    async def translate(self, intake: ChatIntake) -> ChatJob:
        prefills = self.pool.healthy(PREFILL)
        if not prefills:
            raise NoHealthyServer(PREFILL)
        prefill = prefills[next(self._turn) % len(prefills)]
        body = {k: v for k, v in intake.body.items() if k not in _ROUTER_FIELDS}
        try:  # bounded as every answer is: --read-timeout-s without data
            status, payload = await self.client._exchange(prefill, b"POST", ROUTE,
                                                          orjson.dumps(body))
        except OSError as err:  # the prefill is gone or stalled: as a failed placement
            raise NoHealthyServer(PREFILL) from err
        answer = orjson.loads(payload or b"null")
        if status != 200:
            raise refusal(status, answer)
        return ChatJob(job_of(answer, intake, self.model), intake.model_name, answer["answer"])


def refusal(status: int, answer) -> RequestRejected:
    """SGLang's refusal, its body passed on unchanged."""
    message = answer.get("message") if isinstance(answer, dict) else None
    return RequestRejected(str(message or answer), "server_refused", status=status,
                           payload=answer)


def job_of(answer: dict, intake: ChatIntake, model: ModelInfo) -> GenerateJob:
    sampling = answer["sampling_params"]  # as SGLang built it, its Nones included
    max_new: Optional[int] = sampling.get("max_new_tokens")
    ids = answer["prompt"].get("input_ids")
    prompt = Prompt.of_ids(ids) if ids is not None else text_prompt(answer["prompt"]["text"],
                                                                    max_new, model)
    if not prompt.tokens:
        raise RequestRejected("Messages cannot be empty.", "empty_prompt")
    _check_context(prompt, max_new, model)
    return GenerateJob(prompt, sampling, intake.stream, dict(answer["generate"]),
                       _ttft_slo_s(intake.body))
