"""``POST /pdd/chat_request`` on a PDD prefill: SGLang's own chat translation, for the router.

The router serves OpenAI chat completions by sending ``/generate`` to prefill, relay and main;
the body it sends must be the one SGLang's own ``/v1/chat/completions`` would build: the chat
template rendered with the request's tools, tool calls and tool results, ``tool_choice`` and
``response_format`` turned into a grammar, ``logit_bias``, ``chat_template_kwargs``, the model's
default sampling parameters. This route runs exactly that code, the server's
``OpenAIServingChat`` (its ``_validate_request`` and ``_convert_to_internal_request``, with the
server's template, tokenizer and flags), and answers the resulting ``/generate`` fields instead
of generating: the prompt's token ids, the sampling parameters and every other field that
differs from ``GenerateReqInput``'s default. A request SGLang refuses is refused here with
SGLang's own status and message (the pydantic validation by SGLang's exception handler, since
the handler's parameter is SGLang's ``ChatCompletionRequest``).

It also answers what the router needs to parse the answer as SGLang's chat server does
(:mod:`pdd_sglang.router.chat_answer`): the tools in effect, whether tool-call parsing is active,
whether the template forces reasoning, the tool calls already in the history.

Served by SGLang's HTTP process (patch 0018's route hook), on its event loop; the translation
runs in the loop's default executor, as SGLang's ``handle_request`` runs it. No
``from __future__ import annotations``: FastAPI reads the handler's annotations.
"""

import asyncio
import dataclasses
from typing import Any

ROUTE = "/pdd/chat_request"
# /generate fields the router sets itself (or that only describe this HTTP exchange).
_NOT_FORWARDED = frozenset({"text", "input_ids", "sampling_params", "stream", "rid",
                            "bootstrap_host", "bootstrap_port", "bootstrap_room",
                            "received_time", "return_text_in_logprobs", "logprob_start_len",
                            "routing_key", "custom_labels", "routed_dp_rank"})


def add_route(app: Any) -> None:
    """Serve ``POST /pdd/chat_request`` on SGLang's FastAPI app (the launcher's HTTP process)."""
    from fastapi import Depends
    from sglang.srt.entrypoints.http_server import validate_json_request

    app.add_api_route(ROUTE, _handler(), methods=["POST"], include_in_schema=False,
                      dependencies=[Depends(validate_json_request)])


def _handler() -> Any:
    from fastapi import HTTPException, Request
    from fastapi.responses import ORJSONResponse
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    async def pdd_chat_request(request: ChatCompletionRequest, raw_request: Request):
        chat = raw_request.app.state.openai_serving_chat
        # SGLang's OpenAIServingBase.handle_request, up to the generation it starts.
        try:
            error = chat._validate_request(request)
            if error:
                return chat.create_error_response(error)
            adapted, processed = await asyncio.get_running_loop().run_in_executor(
                None, chat._convert_to_internal_request, request, raw_request)
        except HTTPException as err:
            return chat.create_error_response(err.detail, str(err.status_code), err.status_code)
        except ValueError as err:
            return chat.create_error_response(str(err), "BadRequest", 400)
        return ORJSONResponse(translation(chat, adapted, processed))

    return pdd_chat_request


def translation(chat: Any, adapted: Any, request: Any) -> dict:
    """The /generate fields of ``adapted`` (a GenerateReqInput) and the answer's parsing
    context of ``request`` (the ChatCompletionRequest as SGLang left it)."""
    prompt = ({"input_ids": list(adapted.input_ids)} if adapted.input_ids is not None
              else {"text": adapted.text})
    return {"prompt": prompt, "sampling_params": dict(adapted.sampling_params or {}),
            "generate": non_default_fields(adapted), "answer": answer_context(chat, request)}


def non_default_fields(adapted: Any) -> dict:
    """GenerateReqInput's fields that differ from their defaults, less the router's own."""
    out = {}
    for spec in dataclasses.fields(adapted):
        if spec.name in _NOT_FORWARDED or not spec.init:
            continue
        if spec.default is not dataclasses.MISSING:
            default = spec.default
        elif spec.default_factory is not dataclasses.MISSING:
            default = spec.default_factory()
        else:
            default = None
        value = getattr(adapted, spec.name)
        if value != default:
            out[spec.name] = value
    return out


def answer_context(chat: Any, request: Any) -> dict:
    """What SGLang's chat server reads, besides the text, to build the answer."""
    from sglang.srt.parser.response_template import grammar_holds_calls

    tools = chat._effective_tools(request)
    return {
        "tools": [tool.model_dump() for tool in tools],
        "tool_call_parsing": bool(chat._tool_call_parsing_active(request)),
        "force_reasoning": bool(chat.template_manager.force_reasoning
                                or chat._get_reasoning_from_request(request)),
        "history_tool_calls": chat._get_history_tool_calls_cnt(request),
        "parser_prefix": request._response_parser_prefix or "",
        "constrained": bool(grammar_holds_calls(request._response_parser_tool_grammar,
                                                request._response_parser_grammar_start)),
        # Chat encodings that parse their own answers (kimi_k3, dsv32, response templates):
        # the router cannot build those answers.
        "own_encoding": chat._encoding_output() is not None,
        "tool_call_parser": chat.tool_call_parser,
        "reasoning_parser": chat.reasoning_parser,
    }
