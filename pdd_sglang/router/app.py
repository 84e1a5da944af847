"""HTTP endpoints: SGLang's /generate, OpenAI's completions, chat and models, health, metrics.

aiohttp rather than FastAPI: the router's job is relaying streams, and aiohttp cancels a handler
when its client goes away (``handler_cancellation``), which is exactly the signal needed to abort
the request on every server.
"""

from __future__ import annotations

import logging
import time
from contextlib import aclosing

import orjson
from aiohttp import web

from pdd_sglang.router import errors
from pdd_sglang.router.chat_answer import answer_for
from pdd_sglang.router.chat_translation import ChatIntake, ChatTranslator, parse_chat
from pdd_sglang.router.dispatch import StreamEndedEarly
from pdd_sglang.router.openai_format import OpenAIStream
from pdd_sglang.router.request_parsing import (GenerateJob, parse_completion, parse_generate,
                                               parse_json_object, parse_off_loop)
from pdd_sglang.router.service import RouterService
from pdd_sglang.router.servers import MAIN, PREFILL, NoHealthyServer
from pdd_sglang.router.splice import SplicedUpdate, SpliceError
from pdd_sglang.router.upstream import UpstreamError

logger = logging.getLogger("pdd_sglang.router")

_SERVICE = web.AppKey("service", RouterService)
_FAILURES = (UpstreamError, StreamEndedEarly, SpliceError)
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
RESPONSES_REFUSAL = (
    "The PDD router does not serve the Responses API (/v1/responses): use /v1/chat/completions, "
    "sending each turn's messages with its tools, tool calls and tool results (tool_calls and "
    "reasoning_content come back as SGLang's server returns them)")


def _sse(payload) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class EventStream(web.StreamResponse):
    """A streamed answer whose head leaves with its first event, and whose ``[DONE]`` leaves
    with the body's end: two sends fewer per request. aiohttp's StreamResponse sends its head
    alone at ``prepare`` (its Response keeps it for the body: this class attribute); each send
    wakes the client, and hundreds of requests starting at once queue their first tokens
    behind them."""

    _send_headers_immediately = False


async def _until_client_leaves(request: web.Request, response: web.StreamResponse,
                               chunks) -> web.StreamResponse:
    """Stream ``chunks`` (a coroutine writing the answer's chunks) then ``[DONE]``. A client that
    hangs up is usually seen as the handler's cancellation (``handler_cancellation``); when a
    write finds its connection closing first, aiohttp raises ConnectionResetError out of the
    write instead. Either way the request was aborted on every server as the dispatcher's
    context closed (counted as ``client_disconnect``): no error of the router to log."""
    try:
        await chunks
        await response.write_eof(b"data: [DONE]\n\n")
    except ConnectionResetError:
        if request.transport is not None and not request.transport.is_closing():
            raise  # not the client's connection: a fault of the router's own
        logger.debug("client went away mid-stream")
    return response


def _failure_message(err: Exception) -> str:
    if isinstance(err, UpstreamError):
        return f"{err.upstream.role} server failed: {err.message}"
    return str(err)


class Handlers:
    def __init__(self, service: RouterService):
        self.service = service
        self._chat = None

    @property
    def chat(self) -> ChatTranslator:
        if self._chat is None:  # the model is known once the service has started
            self._chat = ChatTranslator(self.service.pool, self.service.client,
                                        self.service.model)
        return self._chat

    def _chat_answer(self, body: dict, context: dict):
        config = self.service.config
        return answer_for(body, context, config.tool_call_parser, config.reasoning_parser,
                          self.service.model.tokenizer)

    # ---- request intake -----------------------------------------------------------------
    async def _intake(self, request: web.Request, parse, api: str):
        """Parse and place, or an error response; nothing reaches a server before this passes."""
        started = time.perf_counter()
        body = None
        try:
            body = parse_json_object(await request.read())
            parsed = await parse_off_loop(parse, body, self.service.model)
            if isinstance(parsed, ChatIntake):  # SGLang's own translation, on a prefill
                parsed = await self.chat.translate(parsed)
                parsed = (parsed.job, parsed.model_name, self._chat_answer(body, parsed.answer))
            job = parsed[0] if isinstance(parsed, tuple) else parsed
            placement = self.service.dispatcher.place(job)
        except errors.RequestRejected as err:
            self.service.metrics.errors.labels(err.cause).inc()
            if api == "generate" and err.kind == "refused" and body.get("stream"):
                return body, None, None, None, await self._stream_refusal(request, err)
            return body, None, None, None, errors.rejection_response(err, api)
        except NoHealthyServer as err:
            self.service.metrics.errors.labels(f"no_healthy_{err.role}").inc()
            return body, None, None, None, errors.upstream_failure_response(str(err), api)
        return body, parsed, placement, started, None

    async def _stream_refusal(self, request, err) -> web.StreamResponse:
        """SGLang refuses a streamed /generate inside the stream: 200, one error chunk, DONE."""
        response = EventStream(status=200, headers=_SSE_HEADERS)
        await response.prepare(request)
        await response.write(errors.generate_stream_error_chunk(err.message, err.status))
        await response.write_eof(b"data: [DONE]\n\n")
        return response

    def _run(self, job: GenerateJob, placement, api: str, started: float):
        """The request's updates, closed on every exit (a disconnect too: the dispatcher's
        aborts run then). A context, not a generator around the dispatcher's: one layer less
        for every chunk relayed."""
        return aclosing(self.service.dispatcher.serve(job, placement, api, started))

    # ---- SGLang /generate ---------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        _, job, placement, started, refusal = await self._intake(request, parse_generate,
                                                                 "generate")
        if refusal is not None:
            return refusal
        if not job.stream:
            final = None
            try:
                async with self._run(job, placement, "generate", started) as updates:
                    async for update in updates:
                        final = update
            except _FAILURES as err:
                return errors.upstream_failure_response(_failure_message(err), "generate", 500)
            return web.Response(body=orjson.dumps(_generate_body(final)),
                                content_type="application/json")
        response = EventStream(status=200, headers=_SSE_HEADERS)
        await response.prepare(request)
        incremental = self.service.config.incremental_streaming_output

        async def chunks() -> None:
            sent_chars = sent_ids = 0  # of the client's text and ids, on an incremental stream
            try:
                async with self._run(job, placement, "generate", started) as updates:
                    async for update in updates:
                        await response.write(_sse(_generate_body(update, sent_chars, sent_ids)))
                        if incremental:
                            sent_chars, sent_ids = len(update.text), len(update.output_ids)
            except _FAILURES as err:
                await response.write(errors.generate_stream_error_chunk(_failure_message(err),
                                                                        500))
        return await _until_client_leaves(request, response, chunks())

    # ---- OpenAI -------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, parse_completion, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, parse_chat, chat=True)

    async def _openai(self, request: web.Request, parse, chat: bool) -> web.StreamResponse:
        body, parsed, placement, started, refusal = await self._intake(request, parse, "openai")
        if refusal is not None:
            return refusal
        job, model_name = parsed[:2]
        api = "chat" if chat else "completions"
        include_usage = job.stream and bool((body.get("stream_options") or {}).get("include_usage"))
        formatter = OpenAIStream(chat, model_name, include_usage, parsed[2] if chat else None)
        if not job.stream:
            final = None
            try:
                async with self._run(job, placement, api, started) as updates:
                    async for update in updates:
                        final = update
            except _FAILURES as err:
                return errors.openai_error(_failure_message(err), 500, "InternalServerError")
            return web.json_response(formatter.response(final), dumps=_dumps)
        response = EventStream(status=200, headers=_SSE_HEADERS)
        await response.prepare(request)

        async def chunks() -> None:
            try:
                async with self._run(job, placement, api, started) as updates:
                    async for update in updates:
                        chunks = (formatter.chunks(update) if formatter.answer is None
                                  else await formatter.parsed_chunks(update))
                        for chunk in chunks:
                            await response.write(_sse(chunk))
            except _FAILURES as err:
                await response.write(_sse({"error": {"message": _failure_message(err),
                                                     "type": "InternalServerError", "code": 500}}))
        return await _until_client_leaves(request, response, chunks())

    async def responses(self, request: web.Request) -> web.Response:
        """OpenAI's Responses API is refused, naming what to use: a response keeps server-side
        state (``store``, ``previous_response_id``, background runs) on the one server that made
        it, and runs its built-in tools in loops of several generations, while the router
        splices one generation per request across three servers. An agent sends each turn to
        /v1/chat/completions with its tools, tool calls and tool results instead."""
        self.service.metrics.errors.labels("responses_api").inc()
        return web.json_response({"error": {
            "message": RESPONSES_REFUSAL, "type": "Not Implemented", "param": None,
            "code": 501}}, status=501, dumps=_dumps)

    async def models(self, request: web.Request) -> web.Response:
        model = self.service.model
        card = {"id": model.served_model_name, "object": "model", "created": int(time.time()),
                "owned_by": "sglang", "root": model.model_path, "parent": None,
                "max_model_len": model.context_length}
        return web.json_response({"object": "list", "data": [card]}, dumps=_dumps)

    # ---- operations ---------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        pool = self.service.pool
        ok = bool(pool.healthy(PREFILL)) and bool(pool.healthy(MAIN))
        # The status is the answer (as SGLang's); the body, each server as the router sees it.
        return web.json_response({"servers": pool.health_view()}, status=200 if ok else 503,
                                 dumps=_dumps)

    async def metrics(self, request: web.Request) -> web.Response:
        body = self.service.metrics.render(self.service.pool)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def model_info(self, request: web.Request) -> web.Response:
        model = self.service.model
        return web.json_response({"model_path": model.model_path,
                                  "served_model_name": model.served_model_name,
                                  "tokenizer_path": model.model_path, "is_generation": True},
                                 dumps=_dumps)

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(await self.service.servers_info(), dumps=_dumps)

    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = await self.service.flush_cache()
        return web.Response(status=200 if ok else 500, text="Cache flushed.\n" if ok else
                            "Cache flush failed on some server.\n")


def _generate_body(update: SplicedUpdate, sent_chars: int = 0, sent_ids: int = 0) -> dict:
    """SGLang's /generate chunk: the text and ids after what the client has (all of them on a
    cumulative stream)."""
    return {"text": update.text[sent_chars:] if sent_chars else update.text,
            "output_ids": list(update.output_ids[sent_ids:]), "meta_info": update.meta}


def _dumps(value) -> str:
    return orjson.dumps(value).decode()


def build_app(service: RouterService) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[_SERVICE] = service
    handlers = Handlers(service)
    app.router.add_post("/generate", handlers.generate)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_route("*", "/v1/responses", handlers.responses)
    app.router.add_route("*", "/v1/responses/{tail:.*}", handlers.responses)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_get("/model_info", handlers.model_info)
    app.router.add_get("/get_model_info", handlers.model_info)
    app.router.add_get("/server_info", handlers.server_info)
    app.router.add_post("/flush_cache", handlers.flush_cache)

    async def on_startup(app: web.Application) -> None:
        await service.start()

    async def on_cleanup(app: web.Application) -> None:
        await service.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
