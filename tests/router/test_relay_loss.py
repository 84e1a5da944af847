"""A relay's death costs time to first token, never the answer (router/relay_loss.py).

Pure logic: the dispatcher against a scripted in-memory client whose streams are driven by
events (no sockets, no sleeps), so each test shows one ordering of a relay's death exactly.
"""

from __future__ import annotations

import asyncio
import time

from pdd_sglang.protocol.messages import FINISHED_AT_RELAY
from pdd_sglang.router.config import LinkParams, PrefillEndpoint, RouterConfig
from pdd_sglang.router.dispatch import Dispatcher
from pdd_sglang.router.metrics import RouterMetrics
from pdd_sglang.router.model import ModelInfo
from pdd_sglang.router.placement import Placer
from pdd_sglang.router.prefix_mirror import PrefixMirror
from pdd_sglang.router.landing import LandingCopies
from pdd_sglang.router.relay_loss import MainSilence
from pdd_sglang.router.prompt import Prompt
from pdd_sglang.router.request_parsing import GenerateJob
from pdd_sglang.router.servers import (HEALTH_OK, HEALTH_UNREACHABLE, MAIN, PREFILL, RELAY,
                                       HealthMonitor, ServerPool)
from pdd_sglang.router.splice import UpstreamChunk
from pdd_sglang.router.upstream import UpstreamError

PROMPT = [5, 6, 7]
LENGTH = {"type": "length", "length": 4}
STOP = {"type": "stop", "matched": 2}


class WordTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


async def forever():
    await asyncio.Event().wait()


def chunk(ids, finish=None, completion=None):
    meta = {"finish_reason": finish, "cached_tokens": 0,
            "completion_tokens": len(ids) if completion is None else completion}
    return UpstreamChunk(list(ids), None, meta, finish is not None)


class ScriptedClient:
    """UpstreamClient's surface. ``streams[role]`` / ``answers`` hold one async function per
    call, in call order; ``log`` records every generate and abort as it happens."""

    def __init__(self, streams: dict, answers: list):
        self.streams = {role: list(calls) for role, calls in streams.items()}
        self.answers = list(answers)
        self.log: list[tuple] = []
        self.bodies: dict[str, list[dict]] = {RELAY: [], MAIN: [], PREFILL: []}
        self.health_of: dict[str, str] = {}

    async def stream_into(self, upstream, body, deliver):
        self.log.append(("generate", upstream.role, body["rid"]))
        self.bodies[upstream.role].append(body)
        async for item in self.streams[upstream.role].pop(0)(upstream):
            deliver(item)

    async def generate_final(self, upstream, body):
        self.log.append(("generate", upstream.role, body["rid"]))
        self.bodies[PREFILL].append(body)
        return await self.answers.pop(0)(upstream)

    async def abort(self, upstream, rid):
        self.log.append(("abort", upstream.role, rid))

    async def relay_notice(self, upstream, kind, rooms):
        self.log.append((kind, upstream.role, tuple(rooms)))
        return 202

    async def health(self, upstream, timeout_s: float = 10.0):
        return self.health_of.get(upstream.url, HEALTH_OK)

    def aborted(self, role: str, rid: str) -> bool:
        return ("abort", role, rid) in self.log


def make_dispatcher(client: ScriptedClient, grace_s: float = 0.0) -> Dispatcher:
    pool = ServerPool([PrefillEndpoint("http://p", 9000)], ["http://r"], ["http://m"])
    for upstream in pool.all():
        upstream.max_running_requests = 4
    pool.by_role[RELAY][0].control_address = "tcp://127.0.0.1:7000"
    mirrors = {"http://m": PrefixMirror(10**6)}
    # 1 byte/s: every uncached prompt is worth hiding behind the relay (P->RLD->MD).
    config = RouterConfig(prefills=(), mains=("http://m",), relays=("http://r",),
                          link=LinkParams(1.0, 0.0), placement="idle-line", retry_max_retries=0,
                          relay_loss_main_grace_s=grace_s)
    placer = Placer(pool, mirrors, config, 1.0)
    health = HealthMonitor(pool, client, interval_s=5.0, failures_to_remove=2)
    model = ModelInfo("m", "m", 4096, WordTokenizer(), 1.0)
    return Dispatcher(pool, placer, mirrors, client, health, RouterMetrics(), model, config)


async def answer_without_drain(dispatcher: Dispatcher, max_new_tokens: int = 4) -> list:
    """The client's updates; what the router does after the answer may still be running."""
    job = GenerateJob(Prompt.of_ids(PROMPT), {"max_new_tokens": max_new_tokens}, stream=True)
    return [u async for u in dispatcher.serve(job, dispatcher.place(job), "generate",
                                              time.perf_counter())]


async def answer(dispatcher: Dispatcher, max_new_tokens: int = 4) -> list:
    updates = await answer_without_drain(dispatcher, max_new_tokens)
    await dispatcher.drain()  # the aborts the attempts left behind
    return updates


def run(coro):
    # A guard, not a wait: every test finishes in milliseconds unless the router hangs.
    return asyncio.run(asyncio.wait_for(coro, 30))


def pipeline_of(body: dict) -> str:
    return body["kv_hints"]["actions"][0]["payload"]["pipeline"]


def relay_dies_unnoticed(relay_ids: list[list[int]], continuation: list) -> ScriptedClient:
    """The relay streams ``relay_ids`` (cumulative) and resets before main, which never connected
    to it, says anything; main's copy lands after the death; the continuation on a fresh
    placement streams the ``continuation`` chunks. The router's probe finds the relay gone."""
    died = asyncio.Event()

    async def relay_then_reset(upstream):
        for ids in relay_ids:
            yield chunk(ids)
        died.set()
        raise UpstreamError(upstream, "ServerDisconnectedError", "upstream_connection")

    async def waits_for_a_handoff(upstream):
        await forever()
        yield

    async def continues(upstream):
        for item in continuation:
            yield item

    async def lands_after_the_relay_died(upstream):
        await died.wait()
        return {}

    async def answered(upstream):
        return {}

    client = ScriptedClient({RELAY: [relay_then_reset], MAIN: [waits_for_a_handoff, continues]},
                            [lands_after_the_relay_died, answered])
    client.health_of["http://r"] = HEALTH_UNREACHABLE
    return client


def test_a_relay_refusing_the_connection_is_out_at_once_and_the_request_goes_p_to_md():
    async def refused(upstream):
        raise UpstreamError(upstream, "Connect call failed", "upstream_connection",
                            refused=True)
        yield  # an async generator

    async def waits_for_a_handoff(upstream):  # main's first attempt: nothing ever comes
        await forever()
        yield

    async def decodes(upstream):
        yield chunk([10])
        yield chunk([10, 11], LENGTH)

    async def waits_for_the_relay(upstream):  # prefill waiting for the relay to register
        await forever()

    async def answered(upstream):
        return {}

    async def test():
        client = ScriptedClient({RELAY: [refused], MAIN: [waits_for_a_handoff, decodes]},
                                [waits_for_the_relay, answered])
        dispatcher = make_dispatcher(client)
        updates = await answer(dispatcher, max_new_tokens=2)
        assert updates[-1].output_ids == [10, 11] and updates[-1].finished
        assert updates[-1].meta["pdd"]["outcome"] == "relay_lost"
        (relay,) = dispatcher.pool.by_role[RELAY]
        assert not relay.healthy  # one refusal, though two failures are asked of a poll
        first, second = client.bodies[MAIN]
        assert pipeline_of(first) == "prefill_relay_main"
        assert pipeline_of(second) == "prefill_main"  # no wait for any relay timeout
        assert second["input_ids"] == PROMPT  # from scratch: the client had nothing
        assert client.aborted(MAIN, first["rid"]) and client.aborted(PREFILL, first["rid"])
        assert len(client.bodies[RELAY]) == 1

    run(test())


def test_a_relay_dying_mid_answer_goes_on_at_main_from_the_clients_last_token():
    """Main never connected to the relay, so it never notices: once its copy has landed (the
    prefill answered) and main stays silent, the router continues the request on main."""
    async def test():
        # The continuation's own ids, from its first token.
        client = relay_dies_unnoticed([[10], [10, 11]], [chunk([12], completion=1),
                                                         chunk([12, 13], LENGTH, completion=2)])
        dispatcher = make_dispatcher(client, grace_s=0.0)
        updates = await answer(dispatcher)
        assert [u.output_ids for u in updates] == [[10], [10, 11], [10, 11, 12],
                                                   [10, 11, 12, 13]]
        last = updates[-1]
        assert last.text == "w10 w11 w12 w13"
        assert last.meta["resumed_after_tokens"] == 2 and last.meta["completion_tokens"] == 4
        assert last.meta["pdd"]["outcome"] == "relay_lost"
        first, second = client.bodies[MAIN]
        # The continuation: prompt + the client's tokens, for the tokens still owed, P->MD.
        assert second["input_ids"] == PROMPT + [10, 11]
        assert second["sampling_params"]["max_new_tokens"] == 2
        assert pipeline_of(second) == "prefill_main"
        # Main's first copy was aborted before the continuation reached main, so main had
        # cached the prompt by then.
        assert client.log.index(("abort", MAIN, first["rid"])) < client.log.index(
            ("generate", MAIN, second["rid"]))
        assert not dispatcher.pool.by_role[RELAY][0].healthy  # the probe's verdict
        # The prefill was told: main's copy of the room is the request's only way on now.
        await asyncio.sleep(0.05)  # the notices' batching interval
        assert ("relay_lost", PREFILL, (first["bootstrap_room"],)) in client.log

    run(test())


def test_text_held_back_for_a_stop_string_goes_on_before_the_continuations():
    """The client had w10 w11 and the relay's w12, held back as the possible start of the stop
    string "w12 w13": the continuation after the relay's loss goes on after w12, which it keeps
    (its server sees no stop string across the resume point, resume.py)."""
    async def test():
        client = relay_dies_unnoticed([[10], [10, 11, 12]], [chunk([13], LENGTH, completion=1)])
        dispatcher = make_dispatcher(client, grace_s=0.0)
        job = GenerateJob(Prompt.of_ids(PROMPT), {"max_new_tokens": 4, "stop": ["w12 w13"]},
                          stream=True)
        updates = [u async for u in dispatcher.serve(job, dispatcher.place(job), "generate",
                                                     time.perf_counter())]
        await dispatcher.drain()
        assert [u.text for u in updates] == ["w10", "w10 w11 ", "w10 w11 w12 w13"]
        assert client.bodies[MAIN][1]["input_ids"] == PROMPT + [10, 11, 12]

    run(test())


def test_a_relay_dying_before_its_first_token_leaves_the_request_to_mains_copy():
    """The relay had the request (its stream broke, the connection was not refused), so prefill
    went on to main: the router waits for main's copy to land rather than putting a second full
    copy on the line behind it, then goes on P->MD with the prompt cached at main."""
    async def test():
        died, copy_may_land, fresh_main = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def relay_resets(upstream):
            died.set()
            raise UpstreamError(upstream, "ServerDisconnectedError", "upstream_connection")
            yield

        async def waits_for_a_handoff(upstream):
            await forever()
            yield

        async def answers(upstream):
            fresh_main.set()
            yield chunk([10], completion=1)
            yield chunk([10, 11], LENGTH, completion=2)

        async def lands_when_let(upstream):
            await copy_may_land.wait()
            return {}

        async def answered(upstream):
            return {}

        client = ScriptedClient({RELAY: [relay_resets], MAIN: [waits_for_a_handoff, answers]},
                                [lands_when_let, answered])
        client.health_of["http://r"] = HEALTH_UNREACHABLE
        dispatcher = make_dispatcher(client, grace_s=0.0)
        serving = asyncio.ensure_future(answer(dispatcher, max_new_tokens=2))
        await died.wait()
        # A fresh placement would reach main within a few turns of the loop; none may come
        # while main's first copy is still on the line.
        try:
            await asyncio.wait_for(fresh_main.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
        assert not fresh_main.is_set(), "placed again with main's first copy still on the line"
        copy_may_land.set()
        updates = await serving
        assert updates[-1].output_ids == [10, 11] and updates[-1].finished
        assert updates[-1].meta["pdd"]["outcome"] == "relay_lost"
        first, second = client.bodies[MAIN]
        assert pipeline_of(first) == "prefill_relay_main"
        assert pipeline_of(second) == "prefill_main"
        assert second["input_ids"] == PROMPT  # the client had nothing yet
        # Main's first copy was aborted once landed (main keeps its KV in the radix cache)
        # before the fresh placement reached main: the prompt does not cross the line again.
        assert client.log.index(("abort", MAIN, first["rid"])) < client.log.index(
            ("generate", MAIN, second["rid"]))
        assert dispatcher.mirrors["http://m"].match_length(PROMPT) == len(PROMPT)

    run(test())


def test_a_main_that_noticed_the_relay_loss_is_left_to_answer():
    async def test():
        landed = asyncio.Event()

        async def relay_then_eof(upstream):
            yield chunk([10])
            # The stream ends without a finish: the relay is gone.

        async def alone_from_the_first_token(upstream):
            await landed.wait()
            yield chunk([10], completion=1)
            yield chunk([10, 11], completion=2)
            yield chunk([10, 11, 12], LENGTH, completion=3)

        async def lands(upstream):
            landed.set()
            return {}

        client = ScriptedClient({RELAY: [relay_then_eof], MAIN: [alone_from_the_first_token]},
                                [lands])
        dispatcher = make_dispatcher(client, grace_s=3600.0)
        updates = await answer(dispatcher, max_new_tokens=3)
        assert updates[-1].output_ids == [10, 11, 12]
        assert updates[-1].meta["pdd"]["outcome"] == "relay_lost"
        assert updates[-1].meta["pdd"]["relay_lost_at"] == 1
        assert len(client.bodies[MAIN]) == 1 and len(client.bodies[PREFILL]) == 1

    run(test())


def test_main_failing_after_the_relay_loss_is_no_error_either():
    """Prefill fails a room when one of its copies fails, so a relay's death can take main's
    copy with it: the request still goes on without the relay (no retry flag needed)."""
    async def test():
        async def relay_then_reset(upstream):
            yield chunk([10])
            raise UpstreamError(upstream, "ServerDisconnectedError", "upstream_connection")

        async def aborted(upstream):
            raise UpstreamError(upstream, "KV transfer failed", "upstream_abort", 500)
            yield

        async def continues(upstream):
            yield chunk([11], completion=1)
            yield chunk([11, 12], LENGTH, completion=2)

        async def never(upstream):
            await forever()

        async def answered(upstream):
            return {}

        client = ScriptedClient({RELAY: [relay_then_reset], MAIN: [aborted, continues]},
                                [never, answered])
        dispatcher = make_dispatcher(client, grace_s=3600.0)
        updates = await answer(dispatcher, max_new_tokens=3)
        assert updates[-1].output_ids == [10, 11, 12]
        assert client.bodies[MAIN][1]["input_ids"] == PROMPT + [10]

    run(test())


def test_copies_kept_to_cache_a_prompt_go_when_their_relay_leaves():
    async def test():
        async def relay_answers_alone(upstream):
            yield chunk([10])
            yield chunk([10, 11], STOP)

        async def waits_for_the_relays_refusal(upstream):
            await forever()
            yield

        async def on_the_line(upstream):
            await forever()

        client = ScriptedClient({RELAY: [relay_answers_alone],
                                 MAIN: [waits_for_the_relays_refusal]}, [on_the_line])
        dispatcher = make_dispatcher(client)
        job = GenerateJob(Prompt.of_ids(PROMPT), {"max_new_tokens": 4}, stream=True)
        updates = [u async for u in dispatcher.serve(job, dispatcher.place(job), "generate",
                                                     time.perf_counter())]
        assert updates[-1].meta["pdd"]["outcome"] == "relay_finished"
        assert len(dispatcher.landing) == 1  # main's copy goes on, to cache the prompt
        rid = client.bodies[MAIN][0]["rid"]
        assert not client.aborted(MAIN, rid)

        (relay,) = dispatcher.pool.by_role[RELAY]
        dispatcher.health.report_unreachable(relay)
        await dispatcher.drain()
        assert len(dispatcher.landing) == 0
        assert client.aborted(MAIN, rid) and client.aborted(PREFILL, rid)
        assert not dispatcher.landing.predecessor("http://m", PROMPT + [1])  # nobody waits

    run(test())


def test_main_silence_counts_from_the_later_of_the_loss_and_the_landing():
    silence = MainSilence(grace_s=1.0)
    assert silence.deadline() is None
    silence.copy_landed_at = 5.0
    assert silence.deadline() is None  # the relay is fine: main waits for its handoff
    silence.relay_lost_at = 3.0
    assert silence.deadline() == 6.0 and silence.remaining(5.5) == 0.5
    assert silence.remaining(7.0) == 0.0
    silence.main_spoke = True
    assert silence.deadline() is None


def test_kept_copies_forget_a_copy_that_ends_by_itself():
    async def test():
        relay = ServerPool([], ["http://r"], []).by_role[RELAY][0]
        copies = LandingCopies()
        dropped = []
        ends = copies.add("m", [1], 0, relay, "rid-1", lambda: dropped.append("rid-1"))
        copies.add("m", [2], 0, relay, "rid-2", lambda: dropped.append("rid-2"))
        copies.ended("m", ends)
        assert len(copies) == 1 and copies.kept_for(relay) == 1
        assert copies.drop_for(relay) == ["rid-2"] and dropped == ["rid-2"]
        assert copies.kept_for(relay) == 0 and copies.drop_for(relay) == []

    run(test())


# Main's abort once the relay refused its handoff because it had answered alone
# (pdd_sglang/decode/main.py): the copy landed and main caches the prompt.
CACHED_AT_MAIN = f"PDD relay finished the request itself ({FINISHED_AT_RELAY})"


def _relay_answers_alone_while_main(main_stream):
    async def relay_answers_alone(upstream):
        yield chunk([10])
        yield chunk([10, 11], STOP)

    async def landed(upstream):
        return {}

    return ScriptedClient({RELAY: [relay_answers_alone], MAIN: [main_stream]}, [landed])


def test_the_mirror_holds_a_prompt_the_relay_answered_only_once_mains_copy_has_landed():
    async def test():
        landing = asyncio.Event()

        async def lands_when_told(upstream):
            await landing.wait()
            raise UpstreamError(upstream, CACHED_AT_MAIN, "upstream_abort", 503)
            yield

        dispatcher = make_dispatcher(_relay_answers_alone_while_main(lands_when_told))
        mirror = dispatcher.mirrors["http://m"]
        updates = await answer_without_drain(dispatcher)
        assert updates[-1].meta["pdd"]["outcome"] == "relay_finished"
        await asyncio.sleep(0.01)
        assert mirror.match_length(PROMPT) == 0  # still crossing the WAN: main lacks it
        landing.set()
        await dispatcher.drain()
        assert mirror.match_length(PROMPT) == len(PROMPT)

    run(test())


def test_a_copy_that_failed_or_was_dropped_never_enters_the_mirror():
    async def fails(upstream):
        raise UpstreamError(upstream, "KV transfer of room 7 failed", "upstream_abort", 500)
        yield

    async def waits(upstream):
        await forever()
        yield

    async def test():
        failed = make_dispatcher(_relay_answers_alone_while_main(fails))
        await answer(failed)
        assert failed.mirrors["http://m"].match_length(PROMPT) == 0

        dropped = make_dispatcher(_relay_answers_alone_while_main(waits))
        await answer_without_drain(dropped)
        dropped.health.report_unreachable(dropped.pool.by_role[RELAY][0])  # copy dropped
        await dropped.drain()
        assert dropped.mirrors["http://m"].match_length(PROMPT) == 0

    run(test())
