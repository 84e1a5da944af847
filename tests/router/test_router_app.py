"""The whole router (HTTP in, HTTP out) against scripted fake SGLang servers: the handoff splice
through the APIs, and aborts on every server when the client goes away. Fast, no real servers."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
import pytest
from aiohttp import web

from pdd_sglang.policy import PolicyConfig

from pdd_sglang.router.app import build_app
from pdd_sglang.router.config import LinkParams, PrefillEndpoint, RouterConfig
from pdd_sglang.router.service import RouterService
from pdd_sglang.dev.testing.cluster import free_port
from pdd_sglang.dev.testing.fake_chat import fake_chat_translation
from pdd_sglang.dev.testing.tiny_model import ensure_tiny_model


class FakeServer:
    """Answers like an SGLang server of one role; ``script`` makes its /generate stream."""

    def __init__(self, role: str, model_path: str, script=None, delay_s: float = 0.0,
                 failures: int = 0):
        self.role, self.model_path, self.script, self.delay_s = role, model_path, script, delay_s
        self.failures = failures  # answer this many /generate calls with SGLang's 500
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.aborted: list[str] = []
        self.bodies: list[dict] = []
        self.finished_streams = 0  # streams written to the end (the client read them whole)
        self.arrived_at: list[float] = []  # time.monotonic() of each /generate
        self.finished_at: list[float] = []  # ... and of each stream written to the end
        self.runner = None

    async def start(self):
        app = web.Application()
        async def health(request):
            return web.Response(status=200)

        async def server_info(request):
            state = {"max_total_num_tokens": 10000}
            if self.role == "relay":
                state["pdd"] = {"handoff": {"control_address": "tcp://127.0.0.1:1"}}
            return web.json_response({"max_running_requests": 8, "dtype": "float32",
                                      "pdd_role": self.role, "internal_states": [state]})

        async def model_info(request):
            return web.json_response({"model_path": self.model_path,
                                      "served_model_name": self.model_path})

        app.router.add_get("/health", health)
        app.router.add_get("/server_info", server_info)
        app.router.add_get("/model_info", model_info)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort)
        if self.role == "prefill":
            async def chat_request(request):
                return web.json_response(fake_chat_translation(await request.json()))

            app.router.add_post("/pdd/chat_request", chat_request)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def abort(self, request):
        self.aborted.append((await request.json())["rid"])
        return web.Response()

    async def generate(self, request):
        body = await request.json()
        self.bodies.append(body)
        self.arrived_at.append(time.monotonic())
        if self.role == "prefill":
            if self.failures > 0:
                self.failures -= 1
                return web.json_response({"error": {"message": "Prefill KV transfer failed"}},
                                         status=500)
            return web.json_response({"text": "", "output_ids": [], "meta_info": {}})
        response = web.StreamResponse()
        await response.prepare(request)
        ids = []
        script = self.script(len(self.bodies) - 1) if callable(self.script) else self.script
        for step in script:
            await asyncio.sleep(self.delay_s)
            if step.get("die"):  # the server dies mid-stream: the connection just drops
                request.transport.close()
                return response
            ids = ids + step["ids"]
            prompt = body.get("input_ids") or body["text"].split()  # its tokens: a word each
            meta = {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                    "cached_tokens": step.get("cached", 0), "finish_reason": step.get("finish"),
                    **step.get("meta", {})}
            out = {"text": " ".join(f"w{i - 4}" for i in ids), "output_ids": ids, "meta_info": meta}
            await response.write(b"data: " + json.dumps(out).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        self.finished_streams += 1
        self.finished_at.append(time.monotonic())
        return response

    async def stop(self):
        await self.runner.cleanup()


LENGTH = {"type": "length", "length": 5}
RELAY_SCRIPT = [{"ids": [10]}, {"ids": [11]},
                {"ids": [12], "finish": {"type": "pdd_handoff", "handed_tokens": 3}}]
# As SGLang counts them: completion_tokens includes the 3 handed tokens main holds but does not stream.
MAIN_SCRIPT = [{"ids": [13], "cached": 40, "meta": {"completion_tokens": 4}},
               {"ids": [14], "cached": 40, "finish": LENGTH, "meta": {"completion_tokens": 5}}]


async def with_router(scripts, test, delay_s=0.0, policy=None, prefill_failures=0,
                      retry_after_first_token=False, incremental_streaming_output=False):
    model_path = str(ensure_tiny_model())
    prefill = FakeServer("prefill", model_path, failures=prefill_failures)
    relay = FakeServer("relay", model_path, scripts[0], delay_s)
    main = FakeServer("main", model_path, scripts[1], delay_s)
    for server in (prefill, relay, main):
        await server.start()
    config = RouterConfig(prefills=(PrefillEndpoint(prefill.url, 9999),), relays=(relay.url,),
                          mains=(main.url,), link=LinkParams(1.0, 0.0),  # 1 B/s: always relay
                          retry_after_first_token=retry_after_first_token,
                          incremental_streaming_output=incremental_streaming_output,
                          **({"policy": policy} if policy is not None else {}))
    runner = web.AppRunner(build_app(RouterService(config)), handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as session:
            await test(session, f"http://127.0.0.1:{port}", prefill, relay, main)
    finally:
        await runner.cleanup()
        for server in (prefill, relay, main):
            await server.stop()


async def eventually(condition, timeout_s: float = 10.0) -> None:
    """Poll ``condition`` (the router acts on a request after answering it) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.02)


async def sse(response) -> list:
    events = []
    async for line in response.content:
        line = line.strip()
        if line.startswith(b"data:"):
            events.append(line[5:].strip())
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_handoff_is_spliced_through_every_api():
    async def test(session, url, prefill, relay, main):
        body = {"input_ids": list(range(4, 60)), "sampling_params": {"max_new_tokens": 5}}
        async with session.post(url + "/generate", json=body) as resp:
            whole = await resp.json()
        assert whole["output_ids"] == [10, 11, 12, 13, 14]
        assert whole["text"] == "w6 w7 w8 w9 w10"
        meta = whole["meta_info"]
        assert meta["completion_tokens"] == 5 and meta["cached_tokens"] == 40
        assert meta["finish_reason"] == LENGTH
        assert meta["pdd"]["pipeline"] == "prefill_relay_main" and meta["pdd"]["handed_tokens"] == 3
        # The stage split's marks: received, then the relay's first chunk, then the first token
        # sent; main's first chunk (here main streams at once, beside the relay).
        marks = meta["pdd"]["marks"]
        assert (marks["router_received_ts"] <= marks["relay_first_chunk_ts"]
                <= marks["first_token_ts"]), marks
        assert marks["main_first_chunk_ts"] >= marks["router_received_ts"]
        # The post to prefill, which the demo's split starts prefill's side from.
        assert marks["router_received_ts"] <= marks["prefill_sent_ts"] <= marks["first_token_ts"]
        assert meta["pdd"]["line_bytes_ahead"] == 0  # nothing else on the line
        # Every server got the same rid, room, bootstrap address and route.
        sent = [s.bodies[-1] for s in (prefill, relay, main)]
        assert len({(b["rid"], b["bootstrap_room"], b["bootstrap_port"]) for b in sent}) == 1
        assert sent[0]["bootstrap_port"] == 9999 and sent[0]["bootstrap_host"] == "127.0.0.1"
        assert sent[0]["kv_hints"]["actions"][0]["payload"] == {
                "pipeline": "prefill_relay_main", "relay_control": "tcp://127.0.0.1:1"}

        async with session.post(url + "/generate", json={**body, "stream": True}) as resp:
            chunks = await sse(resp)
        assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5]

        chat = {"messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 5,
                "stream": True, "stream_options": {"include_usage": True}}
        async with session.post(url + "/v1/chat/completions", json=chat) as resp:
            chunks = await sse(resp)
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == "w6 w7 w8 w9 w10"
        assert chunks[-1]["usage"]["completion_tokens"] == 5
        assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 40}

        async with session.get(url + "/metrics") as resp:
            metrics = await resp.text()
        assert 'pdd_router_handoff_total{mode="unknown",outcome="handoff"} 3.0' in metrics
            # Measured for every request: the router streams from the servers even for a whole answer.
        assert "pdd_router_handoff_gap_seconds_count 3.0" in metrics

    asyncio.run(with_router([RELAY_SCRIPT, MAIN_SCRIPT], test))


RELAY_DONE = [{"ids": [10]}, {"ids": [11], "finish": {"type": "stop", "matched": 2}}]


def test_relay_finishing_alone_aborts_main_for_singular_traffic():
    async def test(session, url, prefill, relay, main):
        async with session.post(url + "/generate", json={"input_ids": [5, 6, 7]}) as resp:
            whole = await resp.json()
        assert whole["output_ids"] == [10, 11]
        assert whole["meta_info"]["pdd"]["outcome"] == "relay_finished"
        await eventually(lambda: main.aborted and prefill.aborted)
        assert main.aborted == [main.bodies[-1]["rid"]]
        assert prefill.aborted == [main.bodies[-1]["rid"]]
        assert relay.aborted == []

    # Every prompt counts as singular: 0 uncached tokens suffice, 2 output tokens are few.
    policy = PolicyConfig(singular_min_uncached_tokens=0, singular_max_new_tokens=2)
    asyncio.run(with_router([RELAY_DONE, MAIN_SCRIPT * 20], test, delay_s=0.05, policy=policy))


def test_relay_finishing_alone_lets_main_cache_the_prompt_otherwise():
    async def test(session, url, prefill, relay, main):
        async with session.post(url + "/generate", json={"input_ids": [5, 6, 7]}) as resp:
            whole = await resp.json()
        assert whole["output_ids"] == [10, 11]
        assert whole["meta_info"]["pdd"]["outcome"] == "relay_finished"
        # Main's copy runs on (its stream is drained, not closed): main caches the prompt.
        await eventually(lambda: main.finished_streams == 1)
        assert main.aborted == [] and prefill.aborted == []

    asyncio.run(with_router([RELAY_DONE, MAIN_SCRIPT], test, delay_s=0.05))


def test_client_disconnect_aborts_on_every_server():
    endless = [{"ids": [10]}] * 400

    async def test(session, url, prefill, relay, main):
        async with session.post(url + "/generate",
                                json={"input_ids": [5, 6, 7], "stream": True}) as resp:
            await resp.content.readline()
        # Leaving the block closed the connection mid-stream.
        for _ in range(50):
            if relay.aborted and main.aborted and prefill.aborted:
                break
            await asyncio.sleep(0.1)
        rid = relay.bodies[-1]["rid"]
        assert relay.aborted == [rid] and main.aborted == [rid] and prefill.aborted == [rid]
        async with session.get(url + "/metrics") as resp:
            assert 'pdd_router_errors_total{cause="client_disconnect"} 1.0' in await resp.text()

    asyncio.run(with_router([endless, endless], test, delay_s=0.05))


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_a_client_gone_before_a_write_is_aborted_and_no_router_error(path, monkeypatch, caplog):
    """The write, not the handler's cancellation, finds the client gone (aiohttp raises
    ConnectionResetError out of it): the chaos soak's router logged that as "Error handling
    request", a traceback the soak counts as a dead thread."""
    from aiohttp.client_exceptions import ClientConnectionResetError

    from pdd_sglang.router.app import _SERVICE

    endless = [{"ids": [10]}] * 400
    original = web.StreamResponse.write
    writes = {"n": 0}

    async def write(self, data):
        if _SERVICE in self._req.app:  # the router's stream, not a fake server's
            writes["n"] += 1
            if writes["n"] == 2:  # the client's connection closes under the second chunk
                self._req.transport.close()
                raise ClientConnectionResetError("Cannot write to closing transport")
        return await original(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write)

    async def test(session, url, prefill, relay, main):
        async with session.get(url + "/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        body = {"stream": True, **({"input_ids": [5, 6, 7]} if path == "/generate"
                                   else {"model": model, "prompt": [5, 6, 7]})}
        with pytest.raises(aiohttp.ClientError):
            async with session.post(url + path, json=body) as resp:
                async for _ in resp.content:
                    pass
        await eventually(lambda: relay.aborted and main.aborted and prefill.aborted)
        rid = relay.bodies[-1]["rid"]
        assert relay.aborted == [rid] and main.aborted == [rid] and prefill.aborted == [rid]

    with caplog.at_level("DEBUG"):
        asyncio.run(with_router([endless, endless], test, delay_s=0.05))
    assert writes["n"] == 2
    # The fake servers log their own writes to the connections the router aborted: not ours.
    router_errors = [r for r in caplog.records if r.levelname == "ERROR" and r.exc_info
                     and "pdd_sglang/router" in logging.Formatter().formatException(r.exc_info)]
    assert not router_errors, caplog.text[-3000:]


ABORTED = {"type": "abort", "message": "KV transfer failed", "status_code": 500}
# What main streams when it decodes from the first token: no handoff, the whole answer.
MAIN_ALONE = [{"ids": [10], "cached": 0, "meta": {"completion_tokens": 1}},
              {"ids": [11], "cached": 0, "finish": LENGTH, "meta": {"completion_tokens": 2}}]


def test_a_relay_abort_before_any_token_hands_the_request_to_main():
    # SGLang streams its own aborts (a failed KV transfer, a waiting timeout) as a last chunk
    # with no tokens; read as an answer, the client would get an empty one.
    async def test(session, url, prefill, relay, main):
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
        async with session.post(url + "/generate", json=body) as resp:
            assert resp.status == 200
            whole = await resp.json()
        assert whole["output_ids"] == [10, 11]
        assert whole["meta_info"]["pdd"]["outcome"] == "relay_lost"
        async with session.get(url + "/metrics") as resp:
            assert 'pdd_router_errors_total{cause="relay_lost"} 1.0' in await resp.text()

    asyncio.run(with_router([[{"ids": [], "finish": ABORTED}], MAIN_ALONE], test, delay_s=0.05))


def test_a_main_abort_after_the_first_token_reaches_the_client_as_an_error_with_its_reason():
    async def test(session, url, prefill, relay, main):
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 5}, "stream": True}
        async with session.post(url + "/generate", json=body) as resp:
            events = await sse(resp)
        assert events[-2]["output_ids"] == [10, 11]  # the relay's tokens, then...
        assert "error" in events[-1], events  # ...main's failure, not a short "answer"
        assert "KV transfer failed" in events[-1]["error"]["message"]
        async with session.get(url + "/metrics") as resp:
            metrics = await resp.text()
        assert 'pdd_router_errors_total{cause="upstream_abort"} 1.0' in metrics
        # The client has part of the answer: re-sending would repeat it, so no retry.
        assert "pdd_router_retries_total{" not in metrics
        assert len(prefill.bodies) == 1

    handoff = [{"ids": [10]}, {"ids": [11], "finish": {"type": "pdd_handoff", "handed_tokens": 2}}]
    asyncio.run(with_router([handoff, [{"ids": [], "finish": ABORTED}]], test, delay_s=0.05))


def test_a_failure_before_the_first_token_is_retried_on_a_fresh_placement():
    async def test(session, url, prefill, relay, main):
        body = {"input_ids": list(range(4, 60)), "sampling_params": {"max_new_tokens": 5}}
        async with session.post(url + "/generate", json=body) as resp:
            assert resp.status == 200, await resp.text()
            whole = await resp.json()
        assert whole["output_ids"] == [10, 11, 12, 13, 14]  # whole, as if nothing happened
        first, second = (b["rid"] for b in prefill.bodies)
        assert first != second and len(prefill.bodies) == 2
        # The failed attempt is dropped everywhere.
        await eventually(lambda: all(first in s.aborted for s in (relay, main, prefill)))
        async with session.get(url + "/metrics") as resp:
            assert 'pdd_router_retries_total{cause="upstream_status"} 1.0' in await resp.text()

    asyncio.run(with_router([RELAY_SCRIPT, MAIN_SCRIPT], test, delay_s=0.05,
                            prefill_failures=1))


def test_retries_end_with_the_failure():
    async def test(session, url, prefill, relay, main):
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 5}}
        async with session.post(url + "/generate", json=body) as resp:
            assert resp.status == 500
            assert "KV transfer failed" in (await resp.json())["error"]["message"]
        assert len(prefill.bodies) == 2  # the first try and one retry (the default)

    asyncio.run(with_router([RELAY_SCRIPT, MAIN_SCRIPT], test, delay_s=0.05,
                            prefill_failures=5))


@pytest.mark.parametrize("body,status", [(b"{oops", 400), (b'{"input_ids": []}', 400)])
def test_bad_requests_never_reach_a_server(body, status):
    async def test(session, url, prefill, relay, main):
        async with session.post(url + "/generate", data=body) as resp:
            assert resp.status == status
        assert not prefill.bodies and not relay.bodies and not main.bodies

    asyncio.run(with_router([RELAY_SCRIPT, MAIN_SCRIPT], test))


def test_responses_api_is_refused_naming_chat_completions_and_images_by_their_part():
    async def test(session, url, prefill, relay, main):
        async with session.post(url + "/v1/responses", json={"input": "w1"}) as resp:
            assert resp.status == 501
            error = (await resp.json())["error"]
        assert "/v1/chat/completions" in error["message"] and error["code"] == 501
        async with session.get(url + "/v1/responses/resp_1") as resp:
            assert resp.status == 501
        image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]
        async with session.post(url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": image}]}) as resp:
            assert resp.status == 400
            error = await resp.json()
        assert error["message"].startswith("messages[0].content[0] of type 'image_url'")
        assert error["type"] == "BadRequestError"
        assert not prefill.bodies and not relay.bodies and not main.bodies

    asyncio.run(with_router([RELAY_SCRIPT, MAIN_SCRIPT], test))


def test_the_next_turn_reaches_main_only_once_the_previous_copy_has_landed():
    async def test(session, url, prefill, relay, main):
        for prompt in ([5, 6, 7], [5, 6, 7, 8]):  # turn 2 extends turn 1
            async with session.post(url + "/generate", json={"input_ids": prompt}) as resp:
                whole = await resp.json()
            assert whole["meta_info"]["pdd"]["outcome"] == "relay_finished"
        for _ in range(100):  # main's two streams, 1.2 s each, one after the other
            if main.finished_streams == 2:
                break
            await asyncio.sleep(0.1)
        # Turn 1's copy (main's stream, 1.2 s) was still landing when turn 2 came: main got
        # turn 2 only after it, while the relay and prefill got it at once.
        assert len(main.arrived_at) == 2 and main.finished_streams == 2
        assert main.arrived_at[1] >= main.finished_at[0]
        assert relay.arrived_at[1] < main.finished_at[0]
        async with session.get(url + "/metrics") as resp:
            assert 'pdd_router_main_waits_total{end="landed"} 1.0' in await resp.text()

    asyncio.run(with_router([RELAY_DONE, MAIN_SCRIPT * 6], test, delay_s=0.1))


def _main_dies_after(tokens: list[int]):
    """Main's stream on the first call: ``tokens``, then the process dies; later calls answer."""
    def script(call: int):
        if call == 0:
            # As SGLang counts: completion_tokens includes the 2 handed tokens.
            return [{"ids": [t], "meta": {"completion_tokens": 3 + i}}
                    for i, t in enumerate(tokens)] + [{"die": True}]
        return [{"ids": [20]}, {"ids": [21], "finish": LENGTH}]
    return script


def test_main_dying_after_the_handoff_is_a_clear_error_by_default():
    async def test(session, url, prefill, relay, main):
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 7}, "stream": True}
        async with session.post(url + "/generate", json=body) as resp:
            events = await sse(resp)
        assert events[-2]["output_ids"] == [10, 11, 12, 13]
        assert "error" in events[-1], events
        assert len(prefill.bodies) == 1

    handoff = [{"ids": [10]}, {"ids": [11], "finish": {"type": "pdd_handoff", "handed_tokens": 2}}]
    asyncio.run(with_router([handoff, _main_dies_after([12, 13])], test, delay_s=0.05))


def test_with_retry_after_first_token_the_answer_goes_on_from_the_last_token_sent():
    async def test(session, url, prefill, relay, main):
        body = {"input_ids": [5, 6, 7], "stream": True,
                "sampling_params": {"max_new_tokens": 7, "min_new_tokens": 5}}
        async with session.post(url + "/generate", json=body) as resp:
            events = await sse(resp)
        assert "error" not in events[-1], events
        # Every position once, in order: the relay's 2, main's 2 before it died, then the rest.
        assert events[-1]["output_ids"] == [10, 11, 12, 13, 20, 21]
        assert [e["output_ids"] for e in events][:4] == [[10], [10, 11], [10, 11, 12],
                                                         [10, 11, 12, 13]]
        meta = events[-1]["meta_info"]
        assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 6
        assert meta["resumed_after_tokens"] == 4
        assert events[-1]["text"] == "w6 w7 w8 w9 w16 w17"
        # The continuation: the prompt plus what the client had, for the tokens still owed.
        resent = prefill.bodies[1]
        assert resent["input_ids"] == [5, 6, 7, 10, 11, 12, 13]
        assert resent["sampling_params"]["max_new_tokens"] == 3
        assert resent["sampling_params"]["min_new_tokens"] == 1
        assert resent["rid"] != prefill.bodies[0]["rid"]

    def relay_script(call: int):
        if call == 0:  # hands off after 2 tokens
            return [{"ids": [10]},
                    {"ids": [11], "finish": {"type": "pdd_handoff", "handed_tokens": 2}}]
        return [{"ids": [20]}, {"ids": [21], "finish": LENGTH}]  # answers the rest alone

    asyncio.run(with_router([relay_script, _main_dies_after([12, 13])], test, delay_s=0.05,
                            retry_after_first_token=True))


def test_servers_that_disagree_after_the_handoff_cost_a_continuation_not_an_error():
    """Main's tokens contradict what the relay already streamed: the client keeps its tokens and
    the answer goes on from them on a fresh placement (even without --retry-after-first-token)."""
    async def test(session, url, prefill, relay, main):
        body = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 6}}
        async with session.post(url + "/generate", json=body) as resp:
            events = await sse(resp)
        assert "error" not in events[-1], events
        assert events[-1]["output_ids"] == [10, 11, 12, 20, 21]
        assert events[-1]["meta_info"]["resumed_after_tokens"] == 3
        assert prefill.bodies[1]["input_ids"] == [5, 6, 7, 10, 11, 12]
        async with session.get(url + "/metrics") as resp:
            assert 'pdd_router_retries_total{cause="splice"} 1.0' in await resp.text()

    def relay_script(call: int):
        if call == 0:  # streams 3 tokens, says it handed 2
            return [{"ids": [10]}, {"ids": [11]},
                    {"ids": [12], "finish": {"type": "pdd_handoff", "handed_tokens": 2}}]
        return [{"ids": [20]}, {"ids": [21], "finish": LENGTH}]

    def main_script(call: int):
        if call == 0:  # from position 2, where the client already has 12: a disagreement
            return [{"ids": [99], "meta": {"completion_tokens": 3}},
                    {"ids": [98], "finish": LENGTH, "meta": {"completion_tokens": 4}}]
        return [{"ids": [20]}, {"ids": [21], "finish": LENGTH}]

    asyncio.run(with_router([relay_script, main_script], test, delay_s=0.05))


# A stop string of two tokens: w8 is token 12, w9 token 13 (the fake servers' words are id - 4).
STOP_STRING = "w8 w9"
STOPPED = {"type": "stop", "matched": STOP_STRING}


def _handoff_after(handed: int) -> list:
    return [{"ids": [10 + i]} for i in range(handed - 1)] + [
        {"ids": [10 + handed - 1], "finish": {"type": "pdd_handoff", "handed_tokens": handed}}]


def _main_from(position: int) -> list:
    """Main's stream from ``position`` up to the stop string's last token (13), which it matches;
    completion_tokens counts from the answer's first token, as SGLang counts after a handoff."""
    ids = range(10 + position, 14)
    return [{"ids": [i], "meta": {"completion_tokens": i - 9},
             **({"finish": STOPPED} if i == 13 else {})} for i in ids]


# (relay, main) scripts in which the client's stream must hold w8 back until w9 shows it is the
# stop string's start. The relay's pdd_handoff chunk carries every token it generated, w8
# included (a finish flushes what SGLang's scheduler held back while w8 could start a stop).
STOP_SPLIT_AFTER_A_HANDOFF = {
    "across_the_handoff": (_handoff_after(3), _main_from(3)),
    "across_mains_chunks": (_handoff_after(2), _main_from(2)),
}
# The relay dies after two tokens; main, decoding alone from the first token, streams w8 and w9
# in two chunks after the client's last position.
STOP_SPLIT_AFTER_A_RELAY_LOSS = ([{"ids": [10]}, {"ids": [11]}, {"die": True}], _main_from(0))


async def _client_views(session, url: str, stop_fields: dict) -> dict:
    """One request per streaming API, each as its client reads it: /generate's texts chunk by chunk
    (cumulative, or pieces with --incremental-streaming-output), the OpenAI APIs' text deltas."""
    views = {}
    generate = {"input_ids": [5, 6, 7], "stream": True,
                "sampling_params": {"max_new_tokens": 6, **stop_fields}}
    async with session.post(url + "/generate", json=generate) as resp:
        events = await sse(resp)
    views["generate"] = [event["text"] for event in events]
    views["outcome"] = events[-1]["meta_info"]["pdd"]["outcome"]
    completion = {"prompt": "w1 w2", "max_tokens": 6, "stream": True, **stop_fields}
    async with session.post(url + "/v1/completions", json=completion) as resp:
        views["completions"] = [e["choices"][0]["text"] for e in await sse(resp) if e["choices"]]
    chat = {"messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 6, "stream": True,
            **stop_fields}
    async with session.post(url + "/v1/chat/completions", json=chat) as resp:
        views["chat"] = [e["choices"][0]["delta"].get("content") or ""
                         for e in await sse(resp) if e["choices"]]
    return views


def _assert_streamed_once(views: dict, expected: str, incremental: bool = False) -> None:
    """Every API's client ends with ``expected`` and was never sent text it had to take back."""
    assert views["outcome"] in ("handoff", "relay_lost"), views  # main's tokens, the router's text
    if incremental:
        assert "".join(views["generate"]) == expected, views
    else:
        texts = views["generate"]
        for before, after in zip(texts, texts[1:]):
            assert after.startswith(before), views  # no chunk takes back what one showed
        assert texts[-1] == expected, views
    for api in ("completions", "chat"):
        assert "".join(views[api]) == expected, (api, views)


def _stop_string_run(scripts, stop_fields: dict, expected: str, incremental: bool = False):
    async def test(session, url, prefill, relay, main):
        _assert_streamed_once(await _client_views(session, url, stop_fields), expected,
                              incremental)

    asyncio.run(with_router(scripts, test, delay_s=0.02,
                            incremental_streaming_output=incremental))


@pytest.mark.parametrize("split", sorted(STOP_SPLIT_AFTER_A_HANDOFF))
def test_a_stop_string_split_across_chunks_after_a_handoff_is_never_sent_then_taken_back(split):
    # SGLang trims the matched stop string: the answer is the text before it.
    _stop_string_run(STOP_SPLIT_AFTER_A_HANDOFF[split], {"stop": [STOP_STRING]}, "w6 w7 ")


def test_a_stop_string_split_across_chunks_after_a_relay_loss_is_never_sent_then_taken_back():
    _stop_string_run(STOP_SPLIT_AFTER_A_RELAY_LOSS, {"stop": [STOP_STRING]}, "w6 w7 ")


def test_a_stop_string_is_held_back_from_incremental_generate_streams_too():
    _stop_string_run(STOP_SPLIT_AFTER_A_HANDOFF["across_the_handoff"], {"stop": [STOP_STRING]},
                     "w6 w7 ", incremental=True)


@pytest.mark.parametrize("scripts", [STOP_SPLIT_AFTER_A_HANDOFF["across_the_handoff"],
                                     STOP_SPLIT_AFTER_A_RELAY_LOSS],
                         ids=["handoff", "relay_loss"])
def test_no_stop_trim_keeps_the_matched_stop_string_in_every_stream(scripts):
    _stop_string_run(scripts, {"stop": [STOP_STRING], "no_stop_trim": True}, "w6 w7 w8 w9")
