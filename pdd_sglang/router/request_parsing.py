"""Client bodies (SGLang /generate, OpenAI completions) turned into one GenerateJob; a chat is
translated by SGLang's own code on a prefill (router/chat_translation.py).

Every check a server would make on its own is made here first, with the server's message, so a
bad request is refused before any server allocates anything for it (and an empty prompt, which
crashes SGLang 0.5.23's CPU scheduler, never reaches one).

A text prompt is not tokenized (:mod:`pdd_sglang.router.prompt`) unless its count could reach
the context limit. Then a long prompt is
tokenized off the event loop (:func:`parse_off_loop`): a 32K-token prompt takes tens of
milliseconds to encode, which would hold every other stream for as long. Hugging Face's fast
tokenizers release the GIL while they encode, so the pool's threads run beside the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar

import orjson

from pdd_sglang.router.errors import RequestRejected
from pdd_sglang.router.model import ModelInfo
from pdd_sglang.router.prompt import Prompt

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # SamplingParams' default when a request names none
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # SGLang's CompletionRequest default
# Fields of /generate the router sets itself for every server.
_ROUTER_OWNED = ("text", "input_ids", "stream", "rid", "bootstrap_host", "bootstrap_port",
                 "bootstrap_room", "kv_hints", "ttft_slo_ms")
# Prompts with fewer characters than this are parsed on the loop: the hop to a thread costs more
# than their encode (tens of microseconds).
OFF_LOOP_MIN_CHARS = 4096
TOKENIZER_THREADS = 4
_pool: Optional[ThreadPoolExecutor] = None
_T = TypeVar("_T")


@dataclass
class GenerateJob:
    prompt: Prompt
    sampling_params: dict
    stream: bool
    extra: dict = field(default_factory=dict)  # other /generate fields, forwarded unchanged
    ttft_slo_s: Optional[float] = None  # the request's own TTFT budget ("ttft_slo_ms"), if any

    @property
    def max_new_tokens(self) -> int:
        value = self.sampling_params.get("max_new_tokens")
        return SGLANG_DEFAULT_MAX_NEW_TOKENS if value is None else value

    @property
    def skip_special_tokens(self) -> bool:
        return self.sampling_params.get("skip_special_tokens", True) is not False


def prompt_chars(body: dict) -> int:
    """Characters the router would tokenize for this body (text, prompt, or chat messages)."""
    total = 0
    for key in ("text", "prompt"):
        if isinstance(body.get(key), str):
            total += len(body[key])
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(p.get("text") or "") for p in content if isinstance(p, dict)
                             and isinstance(p.get("text"), str))
    return total


def _may_tokenize(body: dict, model: ModelInfo) -> bool:
    """Whether parsing ``body`` may run the tokenizer: a text whose token count could reach the
    context with the tokens it asks for (a chat is tokenized by a prefill,
    router/chat_translation.py)."""
    if "messages" in body:
        return False
    sampling = body.get("sampling_params")
    asked = [body.get("max_tokens"), body.get("max_completion_tokens"),
             sampling.get("max_new_tokens") if isinstance(sampling, dict) else None]
    new_tokens = max([n for n in asked if isinstance(n, int)], default=0)
    texts = [body.get(k) for k in ("text", "prompt")]
    return any(isinstance(t, str) and model.estimate.bound(t) + new_tokens >= model.context_length
               for t in texts)


async def parse_off_loop(parse: Callable[[dict, ModelInfo], _T], body: dict,
                         model: ModelInfo) -> _T:
    """``parse(body, model)``, in the tokenizer pool when it may tokenize a prompt long enough
    to matter."""
    global _pool
    if prompt_chars(body) < OFF_LOOP_MIN_CHARS or not _may_tokenize(body, model):
        return parse(body, model)
    if _pool is None:
        _pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="pdd-tokenize")
    return await asyncio.get_running_loop().run_in_executor(_pool, parse, body, model)


async def with_exact_prompt(job: GenerateJob, model: ModelInfo) -> GenerateJob:
    """``job`` with its prompt's token ids (a text prompt tokenized now, in the tokenizer pool
    when long), for what must resend them exactly (a continuation)."""
    global _pool
    if job.prompt.exact:
        return job
    text = job.prompt.text
    if len(text) < OFF_LOOP_MIN_CHARS:
        ids = model.encode(text)
    else:
        if _pool is None:
            _pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="pdd-tokenize")
        ids = await asyncio.get_running_loop().run_in_executor(_pool, model.encode, text)
    return dataclasses.replace(job, prompt=Prompt.of_ids(ids))


def _ttft_slo_s(body: dict) -> Optional[float]:
    """A request's own TTFT budget, ``"ttft_slo_ms"`` (any API); it overrides --ttft-slo-ms."""
    value = body.get("ttft_slo_ms")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise RequestRejected(f"ttft_slo_ms must be a positive number of milliseconds, got "
                              f"{value!r}", "bad_field", "validation")
    return float(value) / 1e3


def parse_json_object(raw: bytes) -> dict:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise RequestRejected(f"JSON decode error: {err}", "malformed_json", "validation") from None
    if not isinstance(body, dict):
        raise RequestRejected("Input should be a JSON object", "malformed_json", "validation")
    return body


def _check_context(prompt: Prompt, max_new_tokens: Optional[int], model: ModelInfo) -> None:
    """SGLang's TokenizerManager checks, word for word (a text prompt fits: text_prompt)."""
    if not prompt.exact:
        return
    prompt_len, context = prompt.tokens, model.context_length
    if prompt_len >= context:
        raise RequestRejected(f"The input ({prompt_len} tokens) is longer than the model's "
                              f"context length ({context} tokens).", "prompt_too_long")
    if max_new_tokens is not None and max_new_tokens + prompt_len > context:
        raise RequestRejected(
            f"Requested token count exceeds the model's maximum context length of {context} "
            f"tokens. You requested a total of {max_new_tokens + prompt_len} tokens: {prompt_len} "
            f"tokens from the input messages and {max_new_tokens} tokens for the completion. "
            f"Please reduce the number of tokens in the input messages or the completion to fit "
            f"within the limit.", "max_tokens_too_large")


def text_prompt(text: str, max_new_tokens: Optional[int], model: ModelInfo) -> Prompt:
    """The text itself when its token count, whatever it is, fits the context; else its exact
    ids, for SGLang's refusal word for word (a blank text too: it may have no token at all)."""
    bound = model.estimate.bound(text)
    if text.strip() and bound < model.context_length and bound + (max_new_tokens or 0) \
            <= model.context_length:
        return Prompt.of_text(text, model.estimate)
    return Prompt.of_ids(model.encode(text))


def _check_token_ids(ids: Any, what: str) -> list[int]:
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in ids):
        raise RequestRejected(f"{what} must be a list of token ids", "bad_field", "validation")
    return ids


def parse_generate(body: dict, model: ModelInfo) -> GenerateJob:
    """An SGLang /generate body: one prompt (text or input_ids), sampling_params, stream."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list) or (isinstance(input_ids, list) and input_ids
                                  and isinstance(input_ids[0], list)):
        raise RequestRejected("The PDD router serves one prompt per request; send batches as "
                              "separate requests", "batch_unsupported")
    if text is not None and input_ids is not None:
        raise RequestRejected("Either text or input_ids should be provided.", "bad_field")
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise RequestRejected("sampling_params must be an object", "bad_field", "validation")
    max_new = sampling.get("max_new_tokens")
    if max_new is not None:
        if not isinstance(max_new, int) or isinstance(max_new, bool):
            raise RequestRejected("max_new_tokens must be an integer", "bad_field", "validation")
        if max_new < 0:
            raise RequestRejected(f"max_new_tokens must be at least 0, got {max_new}.",
                                  "negative_max_tokens")
    if text is not None:
        if not isinstance(text, str):
            raise RequestRejected("text must be a string", "bad_field", "validation")
        prompt = text_prompt(text, max_new, model)
    elif input_ids is not None:
        prompt = Prompt.of_ids(_check_token_ids(input_ids, "input_ids"))
    else:
        raise RequestRejected("Either text, input_ids or input_embeds should be provided.",
                              "empty_prompt")
    if not prompt.tokens:
        raise RequestRejected("The prompt is empty.", "empty_prompt")
    _check_context(prompt, max_new, model)
    extra = {k: v for k, v in body.items() if k not in _ROUTER_OWNED and k != "sampling_params"}
    return GenerateJob(prompt, dict(sampling), bool(body.get("stream")), extra,
                       _ttft_slo_s(body))


def check_model(body: dict, model: ModelInfo) -> str:
    name = body.get("model")
    if name is None:
        return "default"
    if not isinstance(name, str):
        raise RequestRejected("model must be a string", "bad_field", "validation")
    if name not in model.known_names():
        raise RequestRejected(f"The model `{name}` does not exist.", "unknown_model", "not_found",
                              404)
    return name


def _openai_sampling(body: dict, max_tokens: Optional[int]) -> dict:
    """OpenAI parameters in SGLang's sampling_params names (SGLang's to_sampling_params)."""
    stop = body.get("stop")
    sampling = {
        "max_new_tokens": max_tokens,
        "stop": [stop] if isinstance(stop, str) else stop,
        "stop_token_ids": body.get("stop_token_ids"),
        "min_new_tokens": body.get("min_tokens", 0),
        "presence_penalty": body.get("presence_penalty", 0.0),
        "frequency_penalty": body.get("frequency_penalty", 0.0),
        "ignore_eos": body.get("ignore_eos", False),
        "skip_special_tokens": body.get("skip_special_tokens", True),
        "no_stop_trim": body.get("no_stop_trim", False),
        "sampling_seed": body.get("seed"),
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "regex", "ebnf",
                 "json_schema"):
        if body.get(name) is not None:
            sampling[name] = body[name]
    return {k: v for k, v in sampling.items() if v is not None}


def _check_openai_common(body: dict, max_field: str) -> Optional[int]:
    if body.get("n", 1) != 1 or body.get("best_of") not in (None, 1):
        raise RequestRejected("The PDD router serves n=1 only", "unsupported_option")
    if body.get("logprobs") or body.get("echo"):
        raise RequestRejected("logprobs and echo are not supported by the PDD router",
                              "unsupported_option")
    max_tokens = body.get(max_field)
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise RequestRejected(f"{max_field} must be an integer", "bad_field", "validation")
        if max_tokens <= 0:  # SGLang's protocol validator: "max_tokens must be positive"
            raise RequestRejected(f"Value error, {max_field} must be positive",
                                  "negative_max_tokens", "validation")
    return max_tokens


def parse_completion(body: dict, model: ModelInfo) -> tuple[GenerateJob, str]:
    name = check_model(body, model)
    if "prompt" not in body:
        raise RequestRejected("Field required: prompt", "bad_field", "validation")
    max_tokens = _check_openai_common(body, "max_tokens")
    if max_tokens is None and "max_tokens" not in body:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if not prompt:
        raise RequestRejected("Prompt cannot be empty", "empty_prompt")
    if isinstance(prompt, str):
        parsed = text_prompt(prompt, max_tokens, model)
    elif isinstance(prompt, list) and isinstance(prompt[0], int):
        parsed = Prompt.of_ids(_check_token_ids(prompt, "prompt"))
    else:
        raise RequestRejected("The PDD router serves one prompt per request", "batch_unsupported")
    if not parsed.tokens:
        raise RequestRejected("Prompt cannot be empty", "empty_prompt")
    _check_context(parsed, max_tokens, model)
    return GenerateJob(parsed, _openai_sampling(body, max_tokens), bool(body.get("stream")),
                       ttft_slo_s=_ttft_slo_s(body)), name
