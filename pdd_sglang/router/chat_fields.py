"""Every field of SGLang's chat request, honoured or refused by name: none is dropped silently.

The router sends a chat request's body to a prefill's ``/pdd/chat_request`` (SGLang's own
translation, :mod:`pdd_sglang.prefill.chat_request`), so every field that shapes the prompt or
the sampling is honoured exactly as SGLang honours it (HONOURED). What it cannot carry through
the split across prefill, relay and main is refused here with a 400 that names the field
(REFUSED): more than one choice, log probabilities and the other per-token returns, images and
other media, server-side sessions, and the fields that pick a server or a rank, which the
router's placement owns. ``tests/router/test_chat_fields.py`` walks SGLang's
``ChatCompletionRequest`` so a field a new SGLang adds fails the test until it is sorted here.
"""

from __future__ import annotations

from typing import Any, Callable

from pdd_sglang.router.errors import RequestRejected

# Fields SGLang's translation or the router's answer honours as a plain SGLang server does.
HONOURED = frozenset({
    "messages", "model", "frequency_penalty", "logit_bias", "max_tokens",
    "max_completion_tokens", "presence_penalty", "response_format", "seed", "stop", "stream",
    "stream_options", "temperature", "top_p", "user", "tools", "tool_choice",
    "parallel_tool_calls", "reasoning_effort", "thinking", "task", "top_k", "min_p",
    "min_tokens", "regex", "ebnf", "repetition_penalty", "stop_token_ids", "stop_regex",
    "no_stop_trim", "ignore_eos", "continue_final_message", "skip_special_tokens",
    "separate_reasoning", "stream_reasoning", "chat_template_kwargs", "custom_logit_processor",
    "custom_params", "watermark", "input_ids", "extra_key", "cache_salt", "priority",
    # Only read with return_flat_raw_output_top_logprobs, which is refused.
    "return_flat_raw_top_logprobs_b64",
})

_WHY_PLACEMENT = "the PDD router places each request itself"
_WHY_SPLIT = "the PDD router splices one answer from two servers"
_WHY_MEDIA = "the PDD router serves text chats only"

# field -> (is it asked for, why it cannot be honoured)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{name: (lambda v: v is not None, _WHY_PLACEMENT) for name in (
        "bootstrap_host", "bootstrap_port", "bootstrap_room", "routed_dp_rank",
        "disagg_prefill_dp_rank", "data_parallel_rank", "rid")},
    "n": (lambda v: v != 1, "the PDD router serves n=1 only"),
    "logprobs": (bool, _WHY_SPLIT),
    "top_logprobs": (lambda v: v not in (None, 0), _WHY_SPLIT),
    **{name: (bool, _WHY_SPLIT) for name in (
        "return_hidden_states", "return_routed_experts", "return_cached_tokens_details",
        "return_spec_tokens_details", "return_prompt_token_ids", "return_token_ids",
        "return_meta_info", "return_input_ids_in_sglext", "return_output_ids_in_sglext",
        "return_sampling_mask", "return_flat_raw_output_top_logprobs")},
    "routed_experts_start_len": (bool, _WHY_SPLIT),
    "sampling_logprobs_mode": (lambda v: v is not None, _WHY_SPLIT),
    **{name: (bool, _WHY_MEDIA) for name in (
        "max_dynamic_patch", "min_dynamic_patch", "use_audio_in_video", "images_config",
        "video_config", "mm_processor_kwargs")},
    **{name: (lambda v: v is not None, "SGLang's sessions live on one server, and the PDD "
                                       "router uses three") for name in (
        "session_id", "session_params")},
    "lora_path": (lambda v: v is not None, "the PDD router's prefix mirror does not key LoRA "
                                          "adapters"),
}

# Stream options the router's stream carries (SGLang's StreamOptions has these two).
_STREAM_OPTIONS = {"include_usage": lambda v: True,
                   "continuous_usage_stats": lambda v: not v}


def check_fields(body: dict) -> None:
    """Refuse, naming it, the first field the router cannot honour; messages' media too."""
    for name, (asked, why) in REFUSED.items():
        if name in body and asked(body[name]):
            raise RequestRejected(f"{name} is not supported: {why}", f"unsupported_{name}")
    options = body.get("stream_options")
    if isinstance(options, dict):
        for name, value in options.items():
            if name in _STREAM_OPTIONS and not _STREAM_OPTIONS[name](value):
                raise RequestRejected(f"stream_options.{name} is not supported by the PDD "
                                      "router", f"unsupported_stream_options")
    messages = body.get("messages")
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                continue
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in (None, "text"):
                    raise RequestRejected(
                        f"messages[{i}].content[{j}] of type {kind!r} is not supported: "
                        f"{_WHY_MEDIA}", "unsupported_content")
