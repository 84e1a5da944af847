"""A chat answer's ``tool_calls`` and ``reasoning_content``, parsed as SGLang's chat server does.

With ``--tool-call-parser`` / ``--reasoning-parser`` (SGLang's names, the servers' values) the
router runs SGLang's own answer code over the spliced text, whichever server produced each
token: its ``OpenAIServingChat`` methods ``_process_tool_calls`` (a whole answer),
``_process_tool_call_stream`` and ``_check_for_unstreamed_tool_args`` (a streamed one) and
``_process_reasoning_stream``, with SGLang's ``FunctionCallParser`` and ``ReasoningParser``, on
:class:`_Serving`, an ``OpenAIServingChat`` that carries only what those methods read (the
parsers' names, the tokenizer, the template's reasoning flag). What the server's translation
decided for the request (the tools in effect, whether tool-call parsing is active, forced
reasoning, the tool calls in the history) comes with the translation
(:mod:`pdd_sglang.prefill.chat_request`), so no template or model config is loaded here.

A request that needs neither parser gets no :class:`ChatAnswer` and keeps the plain formatter.
Owner: the request's handler on the router's event loop; one per request.
"""

from __future__ import annotations

from typing import Any, Optional

import orjson

from pdd_sglang.router.errors import RequestRejected


def _sglang():
    """SGLang's chat serving (imports torch: loaded with the first request that parses)."""
    from sglang.srt.entrypoints.openai import protocol, serving_chat

    return protocol, serving_chat


class _Template:
    def __init__(self, force_reasoning: bool):
        self.force_reasoning = force_reasoning


class _TokenizerManager:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer


def _serving_class():
    _, serving_chat = _sglang()

    class _Serving(serving_chat.OpenAIServingChat):
        """SGLang's chat serving, built without a tokenizer manager: what its answer methods
        read, and the server's decisions for this request."""

        def __init__(self, tool_call_parser, reasoning_parser, tokenizer, context: dict):
            protocol, _ = _sglang()
            self.tool_call_parser = tool_call_parser
            self.reasoning_parser = reasoning_parser
            self.tokenizer_manager = _TokenizerManager(tokenizer)
            self.template_manager = _Template(context["force_reasoning"])
            self._active = bool(tool_call_parser) and context["tool_call_parsing"]
            self._history = context["history_tool_calls"]
            self._tools = [protocol.Tool.model_validate(t) for t in context["tools"]]

        def _effective_tools(self, request) -> list:
            return self._tools  # the server's, system messages' tools included

        def _tool_call_parsing_active(self, request) -> bool:
            return self._active

        def _get_reasoning_from_request(self, request) -> bool:
            return False  # in the server's force_reasoning already

        def _get_history_tool_calls_cnt(self, request) -> int:
            return self._history

    return _Serving


_SERVING = None


def answer_for(body: dict, context: dict, tool_call_parser: Optional[str],
               reasoning_parser: Optional[str], tokenizer: Any) -> Optional["ChatAnswer"]:
    """The request's answer parser, or None when SGLang's server would parse nothing; a
    refusal when the router's parsers are not the servers'."""
    # The router parses as the servers' own chat serving would, or the answer is not SGLang's.
    for flag, ours, theirs in (("--tool-call-parser", tool_call_parser,
                                context.get("tool_call_parser")),
                               ("--reasoning-parser", reasoning_parser,
                                context.get("reasoning_parser"))):
        if not _same_parser(flag, ours, theirs):
            raise _server_fault(f"the router runs {flag} {ours} and the prefill {theirs}: "
                                "start both with the same", "parser_mismatch")
    # The names the servers resolved them to (SGLang's answer code reads a few of them).
    tool_call_parser, reasoning_parser = context["tool_call_parser"], context["reasoning_parser"]
    separate = reasoning_parser is not None and body.get("separate_reasoning", True) is not False
    tools = bool(tool_call_parser) and context["tool_call_parsing"]
    if not (separate or tools):
        return None
    if context["own_encoding"]:
        raise _server_fault("this model's chat encoding parses its own answers, which the PDD "
                            "router cannot", "unsupported_encoding")
    return ChatAnswer(body, context, tool_call_parser, reasoning_parser if separate else None,
                      tokenizer)


def _server_fault(message: str, cause: str) -> RequestRejected:
    """A refusal that is the deployment's fault, in SGLang's shape for a server error."""
    return RequestRejected(message, cause, status=500, payload={
        "object": "error", "message": message, "type": "InternalServerError", "param": None,
        "code": 500})


def _same_parser(flag: str, ours: Optional[str], theirs: Optional[str]) -> bool:
    """Whether two parser names are one parser in SGLang's tables (a server reports a
    deprecated name, such as ``qwen25``, by the name it resolved it to)."""
    if ours is None or theirs is None or ours == theirs:
        return ours == theirs
    if flag == "--tool-call-parser":
        from sglang.srt.function_call.function_call_parser import FunctionCallParser

        table = FunctionCallParser.ToolCallParserEnum
    else:
        from sglang.srt.parser.reasoning_parser import ReasoningParser

        table = ReasoningParser.DetectorMap
        ours, theirs = ours.lower(), theirs.lower()
    return ours in table and table.get(ours) is table.get(theirs)


class ChatAnswer:
    def __init__(self, body: dict, context: dict, tool_call_parser, reasoning_parser, tokenizer):
        global _SERVING
        protocol, _ = _sglang()
        if _SERVING is None:
            _SERVING = _serving_class()
        self.serving = _SERVING(tool_call_parser, reasoning_parser, tokenizer, context)
        request = protocol.ChatCompletionRequest.model_validate(body)
        request._response_parser_prefix = context["parser_prefix"]
        request._response_parser_tool_grammar = context["constrained"]
        self.request = request
        self.tools_active = self.serving._active
        self._reasoning: dict = {}
        self._calls: dict = {}
        self.has_tool_calls: dict = {}

    # ---- a whole answer -----------------------------------------------------------------
    def whole(self, text: str, finish_reason: Optional[dict]):
        """(content, reasoning_content, tool_calls, finish_reason) of the whole text, as
        SGLang's ``_build_chat_response`` makes them."""
        serving, request = self.serving, self.request
        reasoning, answer_started = None, False
        if serving.reasoning_parser:
            _, serving_chat = _sglang()
            parser = serving_chat.ReasoningParser(
                model_type=serving.reasoning_parser, stream_reasoning=False,
                force_reasoning=serving.template_manager.force_reasoning, request=request,
                tokenizer=serving.tokenizer_manager.tokenizer,
                tool_call_parser_active=self.tools_active)
            reasoning, text = parser.parse_non_stream(text)
            answer_started = serving._answer_started(parser)
        tool_calls = None
        if self.tools_active and not answer_started:
            finish_reason = dict(finish_reason or {"type": "stop"})
            tool_calls, text, finish_reason = serving._process_tool_calls(
                text, serving._effective_tools(request), finish_reason, request.tool_choice,
                serving._history, request._response_parser_prefix,
                request._response_parser_tool_grammar)
        if tool_calls is not None:
            tool_calls = [call.model_dump() for call in tool_calls]
        if not reasoning and serving.reasoning_parser != "k2_horizon":
            reasoning = None
        return text or "", reasoning, tool_calls, finish_reason

    # ---- a streamed answer --------------------------------------------------------------
    async def deltas(self, delta: str, meta: dict, finish_type: Optional[str]) -> list[dict]:
        """The delta messages one piece of the answer's text makes, as SGLang's
        ``_generate_stream_content`` makes them (without logprobs and continuous usage)."""
        serving, request = self.serving, self.request
        content = {"text": delta, "meta_info": meta}
        out = []
        if serving.reasoning_parser:
            reasoning, delta = serving._process_reasoning_stream(
                0, delta, self._reasoning, content, request, finish_type)
            if reasoning:
                out.append({"reasoning_content": reasoning})
        if self.tools_active and not serving._answer_started(self._reasoning.get(0)):
            async for chunk in serving._process_tool_call_stream(
                    0, delta, self._calls, content, request, self.has_tool_calls, created=0,
                    flush=finish_type is not None and finish_type != "abort"):
                if chunk:
                    out.append(_delta_of(chunk))
            if finish_type is not None and 0 in self._calls:
                rest = serving._check_for_unstreamed_tool_args(self._calls[0], content,
                                                               request, 0, created=0)
                if rest:
                    out.append(_delta_of(rest))
        elif delta:
            out.append({"reasoning_content": None, "content": delta})
        return out

    def final_reason(self, reason: Optional[str]) -> Optional[str]:
        """SGLang's streamed finish reason: "tool_calls" after whole tool calls."""
        _, serving_chat = _sglang()
        if (reason == "stop" and self.has_tool_calls.get(0)
                and not serving_chat._incomplete_tool_call_indices(self._calls.get(0))):
            return "tool_calls"
        return reason


def _delta_of(sse: str) -> dict:
    """The delta of one of SGLang's chunks ("data: {...}\\n\\n"), as SGLang wrote it."""
    return orjson.loads(sse[len("data: "):])["choices"][0]["delta"]
