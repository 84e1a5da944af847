"""Fake SGLang servers for the router bench: the protocol both routers speak, tokens at a set rate.

One process serves a prefill, a relay and a main (or PD decode) on three ports, so a router, not
the model, is what the bench measures. What each answers:

- ``/health`` 200; ``/abort_request`` 200; ``/model_info`` and ``/get_model_info`` (the model
  path: the PDD router loads the tokenizer from it).
- ``/server_info``: SGLang's shape with PDD's block: ``pdd_role``; the relay's handoff control
  address; main's Mooncake session; the prefill's ``wan_line``, ``fanout`` and a transfer ledger
  of ``--ledger-rows`` rows (a busy prefill's keeps 8,192), so its size is what a router pays.
- the prefill's ``/pdd/line`` (its compact line report, an idle line by class),
  ``/pdd/cache_only`` (202) and ``/pdd/chat_request`` (a chat's ids and sampling parameters, of
  the route's shape: pdd_sglang.dev.testing.fake_chat), as a PDD prefill of this build serves
  them.
- ``/generate`` on the prefill: SGLang's PD prefill answer (one token, non-streamed, or one chunk
  and ``[DONE]`` when asked to stream), after ``--prefill-ms``.
- ``/generate`` on a decoder (stream): token k of a request leaves at
  ``received + ttft + k / rate`` (the same schedule whichever server sends it), with SGLang's
  ``meta_info`` (``completion_tokens``, ``cached_tokens``, ``finish_reason``). On the relay, a
  request carrying a ``kv_hints`` route through it streams its first ``--handoff-tokens`` tokens
  and ends with ``{"type": "pdd_handoff", "handed_tokens": n}``; main then streams from position
  n on, counting the handed tokens in ``completion_tokens``, as pdd_sglang.decode does. When the
  relay answered alone, main lets its copy go as a PDD main does: one abort chunk whose message
  names the relay's ``finished_at_relay`` refusal.

Token ids are the tiny model's words (ids 4..1003, text ``w<i>``), so the PDD router's own
decode after a handoff gives real text. ``--incremental`` streams only new ids and text per
chunk (SGLang's --incremental-streaming-output), else cumulative ones (SGLang's default).

Life cycle of a decoder stream: 1. parse the body (rid, max_new_tokens, input_ids);
2. main on a relayed route waits for the relay's handoff count (the rid's future, owned by the
event loop: one thread); 3. emit tokens on schedule; 4. the relay resolves the future when it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson
from aiohttp import web

from pdd_sglang.dev.testing.fake_chat import fake_chat_translation
from pdd_sglang.protocol.messages import FINISHED_AT_RELAY

DONE = b"data: [DONE]\n\n"


class Shared:
    """State the three fake servers share in one event loop: the relays' handoff counts by rid."""

    def __init__(self, args):
        self.args = args
        self.handoffs: dict[str, asyncio.Future] = {}

    def handoff(self, rid: str) -> asyncio.Future:
        fut = self.handoffs.get(rid)
        if fut is None:
            fut = self.handoffs[rid] = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_later(120, self.handoffs.pop, rid, None)
        return fut


def _token(k: int) -> int:
    return 4 + (k * 7919) % 1000


def _text(ids) -> str:
    return " ".join(f"w{i - 4}" for i in ids)


def _relayed(body: dict) -> bool:
    """Whether the request's route goes through the relay to main (P->RLD->MD); a relay-only
    route (P->RLD, no main) never hands off."""
    try:
        return body["kv_hints"]["actions"][0]["payload"]["pipeline"] == "prefill_relay_main"
    except (KeyError, IndexError, TypeError):
        return False


def server_info(role: str, args, port: int) -> dict:
    pdd: dict = {"pool": {"in_use_tokens": 0, "locked_tokens": 0}}
    if role == "relay":
        pdd["handoff"] = {"control_address": f"tcp://127.0.0.1:{port + 1000}"}
    if role == "main":
        pdd["mooncake_session"] = f"127.0.0.1:{port + 2000}"
    if role == "prefill":
        rows = [{"room": i, "destination": "127.0.0.1:9", "role": "decode", "bytes": 1 << 20,
                 "pages": 64, "batches": 4, "aux_bytes": 4096} for i in range(args.ledger_rows)]
        pdd["transfers"] = {"by_destination": {}, "by_role": {}, "by_request": rows}
        pdd["wan_line"] = {f"127.0.0.1:{args.main_port + 2000}": {"bytes_ahead": 0,
                                                                  "recent_bytes_per_s": None}}
        pdd["fanout"] = {"mains_out": []}
    return {"pdd_role": role if role != "decode" else None, "max_running_requests": 4096,
            "incremental_streaming_output": args.incremental, "context_length": 65536,
            "dtype": "float32", "max_total_tokens": 10**7,
            "internal_states": [{"max_total_num_tokens": 10**7, "pdd": pdd}]}


RELAY_ANSWERED_ALONE = {"type": "abort", "status_code": 503,
                       "message": f"PDD relay finished the request itself ({FINISHED_AT_RELAY})"}


def build_app(role: str, args, shared: Shared, port: int) -> web.Application:
    info = orjson.dumps(server_info(role, args, port))
    session = f"127.0.0.1:{args.main_port + 2000}"
    line = orjson.dumps({"version": "1", "wan_line": {session: {
        "bytes_ahead": 0, "first_token_bytes_ahead": 0, "needed_now_bytes_ahead": 0,
        "cache_only_bytes_ahead": 0,
        "recent_bytes_per_s": None}}, "mains_out": []})
    model = orjson.dumps({"model_path": args.model_path, "tokenizer_path": args.model_path,
                          "served_model_name": args.model_path, "is_generation": True})

    async def ok(request):
        return web.Response(text="ok")

    async def abort(request):
        await request.read()
        return web.Response(text="ok")

    async def get_info(request):
        return web.Response(body=info, content_type="application/json")

    async def get_model(request):
        return web.Response(body=model, content_type="application/json")

    async def get_line(request):
        return web.Response(body=line, content_type="application/json")

    async def cache_only(request):
        await request.read()
        return web.Response(status=202)

    async def chat_request(request):
        translation = fake_chat_translation(orjson.loads(await request.read()))
        return web.Response(body=orjson.dumps(translation), content_type="application/json")

    async def generate(request):
        body = orjson.loads(await request.read())
        received = time.monotonic()
        if role == "prefill":
            return await prefill(request, body)
        return await decode(request, body, received)

    async def prefill(request, body):
        await asyncio.sleep(args.prefill_ms / 1e3)
        meta = {"id": body.get("rid"), "finish_reason": {"type": "length", "length": 1},
                "prompt_tokens": len(body.get("input_ids") or ()), "completion_tokens": 1,
                "cached_tokens": 0}
        out = {"text": _text([_token(0)]), "output_ids": [_token(0)], "meta_info": meta}
        if not body.get("stream"):
            return web.Response(body=orjson.dumps(out), content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + orjson.dumps(out) + b"\n\n" + DONE)
        return response

    async def decode(request, body, received):
        rid = str(body.get("rid"))
        total = int((body.get("sampling_params") or {}).get("max_new_tokens") or 128)
        prompt = len(body.get("input_ids") or ()) or len(str(body.get("text") or "").split())
        start, end, handoff = 0, total, None
        if role == "relay" and _relayed(body):
            end = min(total, args.handoff_tokens)
            if end < total:
                handoff = end
        elif role == "main" and _relayed(body):
            try:
                start = await asyncio.wait_for(asyncio.shield(shared.handoff(rid)), 60)
            except asyncio.TimeoutError:
                start = 0
            if start is None:  # the relay answered alone: main lets its copy go
                meta = {"id": rid, "finish_reason": RELAY_ANSWERED_ALONE, "prompt_tokens": prompt,
                        "completion_tokens": 0, "cached_tokens": 0}
                out = {"text": "", "output_ids": [], "meta_info": meta}
                return web.Response(body=b"data: " + orjson.dumps(out) + b"\n\n" + DONE,
                                    content_type="text/event-stream")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        rate = args.long_token_rate if total >= args.long_answer_tokens else args.token_rate
        interval = 1.0 / rate if rate > 0 else 0.0
        first_at = received + args.ttft_ms / 1e3
        ids: list[int] = []
        try:
            for k in range(start, end):
                delay = first_at + k * interval - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                token = _token(k)
                ids.append(token)
                last = k == end - 1
                reason = None
                if last:
                    reason = ({"type": "pdd_handoff", "handed_tokens": handoff, "mode": "one-shot"}
                              if handoff is not None else {"type": "length", "length": total})
                meta = {"id": rid, "finish_reason": reason, "prompt_tokens": prompt,
                        "completion_tokens": k + 1, "cached_tokens": 0}
                if args.incremental:
                    out = {"text": (" " if k else "") + _text([token]), "output_ids": [token],
                           "meta_info": meta}
                else:
                    out = {"text": _text(ids), "output_ids": ids, "meta_info": meta}
                await response.write(b"data: " + orjson.dumps(out) + b"\n\n")
            await response.write(DONE)
        finally:
            if role == "relay" and _relayed(body):
                fut = shared.handoff(rid)
                if not fut.done():
                    fut.set_result(handoff)  # None: no handoff, main has nothing to stream
        return response

    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_get("/health", ok)
    app.router.add_get("/health_generate", ok)
    app.router.add_get("/server_info", get_info)
    app.router.add_get("/get_server_info", get_info)
    app.router.add_get("/model_info", get_model)
    app.router.add_get("/get_model_info", get_model)
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort)
    app.router.add_post("/flush_cache", ok)
    if role == "prefill":
        app.router.add_get("/pdd/line", get_line)
        app.router.add_post("/pdd/cache_only", cache_only)
        app.router.add_post("/pdd/chat_request", chat_request)
    return app


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill-port", type=int, required=True)
    p.add_argument("--relay-port", type=int, required=True)
    p.add_argument("--main-port", type=int, required=True)
    p.add_argument("--model-path", required=True, help="whose tokenizer the PDD router loads")
    p.add_argument("--token-rate", type=float, default=50.0,
                   help="tokens/s per stream (0: no wait)")
    p.add_argument("--long-answer-tokens", type=int, default=4096,
                   help="answers of at least this many tokens stream at --long-token-rate")
    p.add_argument("--long-token-rate", type=float, default=1000.0)
    p.add_argument("--ttft-ms", type=float, default=50.0, help="first token after the request")
    p.add_argument("--prefill-ms", type=float, default=20.0)
    p.add_argument("--handoff-tokens", type=int, default=25,
                   help="tokens the relay streams before it hands off to main")
    p.add_argument("--ledger-rows", type=int, default=8192)
    p.add_argument("--incremental", action="store_true")
    return p.parse_args(argv)


async def serve(args) -> None:
    shared = Shared(args)
    runners = []
    for role, port in (("prefill", args.prefill_port), ("relay", args.relay_port),
                       ("main", args.main_port)):
        runner = web.AppRunner(build_app(role, args, shared, port), access_log=None,
                               handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
        runners.append(runner)
    print("fake servers ready", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for runner in runners:
            await runner.cleanup()


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
