"""Error responses in the exact shapes SGLang's HTTP server uses, so clients cannot tell the router
from a plain server when they send something wrong.

SGLang 0.5.23 answers (measured on a plain server; tests/integration/test_router.py,
test_bad_requests_get_sglang_shapes_and_reach_no_server, holds the router's answers against one):
  - body not JSON / not an object / a field of the wrong type (FastAPI validation), any endpoint:
      400 {"object": "error", "message": ..., "type": "Bad Request", "param": null, "code": 400}
  - /generate refusing a request (ValueError from the tokenizer manager):
      400 {"error": {"message": ...}}; when streaming: 200 and one SSE chunk
      {"error": {"message", "type": "invalid_request_error", "code": 400, "retryable": false}}
  - OpenAI endpoints refusing a request:
      400 {"object": "error", "message": ..., "type": "BadRequestError", "param": null, "code": 400}
SGLang serves any model name; OpenAI answers an unknown one with 404 "model_not_found". The
router, which knows its one model, follows OpenAI in SGLang's envelope (type "NotFoundError").
"""

from __future__ import annotations

import orjson
from aiohttp import web


class RequestRejected(Exception):
    """A request refused before any server saw it. ``cause`` labels the error metric."""

    def __init__(self, message: str, cause: str, kind: str = "refused", status: int = 400,
                 payload=None):
        super().__init__(message)
        self.payload = payload  # a server's own refusal, passed on unchanged
        self.message = message
        self.cause = cause
        self.kind = kind  # "validation" (FastAPI-style), "refused" (server-side), "not_found"
        self.status = status


def _json(body: dict, status: int) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def validation_error(message: str) -> web.Response:
    return _json({"object": "error", "message": message, "type": "Bad Request", "param": None,
                  "code": 400}, 400)


def openai_error(message: str, status: int = 400, err_type: str = "BadRequestError",
                 param=None) -> web.Response:
    return _json({"object": "error", "message": message, "type": err_type, "param": param,
                  "code": status}, status)


def generate_error(message: str, status: int = 400) -> web.Response:
    return _json({"error": {"message": message}}, status)


def generate_stream_error_chunk(message: str, code: int = 400) -> bytes:
    return b"data: " + orjson.dumps({"error": {"message": message, "type": "invalid_request_error",
                                               "code": code, "retryable": False}}) + b"\n\n"


def rejection_response(err: RequestRejected, api: str) -> web.Response:
    """The non-streamed answer for ``err`` on ``api`` ("generate" or "openai")."""
    if err.payload is not None:
        return _json(err.payload, err.status)
    if err.kind == "validation":
        return validation_error(err.message)
    if err.kind == "not_found":
        return openai_error(err.message, 404, "NotFoundError", "model")
    if api == "generate":
        return generate_error(err.message, err.status)
    return openai_error(err.message, err.status)


def upstream_failure_response(message: str, api: str, status: int = 503) -> web.Response:
    if api == "generate":
        return generate_error(message, status)
    return openai_error(message, status, "ServiceUnavailableError" if status == 503 else
                        "InternalServerError")
