"""The health monitor: a stall never takes out the only prefill; a dead one does. A stalled main
(e.g. behind a cut line) still leaves: the relay answers alone meanwhile. A refused connection
takes any server out at once, and each server is polled on its own cadence."""

from __future__ import annotations

import asyncio

import pytest

from pdd_sglang.dev.testing.cluster import free_port
from pdd_sglang.router.config import PrefillEndpoint
from pdd_sglang.router.servers import (HEALTH_OK, HEALTH_STALLED, HEALTH_UNREACHABLE, MAIN,
                                       PREFILL, RELAY, HealthMonitor, ServerPool, Upstream)
from pdd_sglang.router.upstream import UpstreamClient, UpstreamError


class ScriptedHealth:
    """Answers each poll of a URL with the next status of its script (pure logic: no server)."""

    def __init__(self, scripts: dict[str, list[str]]):
        self.scripts = {url: list(statuses) for url, statuses in scripts.items()}

    async def health(self, upstream, timeout_s: float = 10.0) -> str:
        return self.scripts[upstream.url].pop(0)


def poll(pool: ServerPool, http: ScriptedHealth, rounds: int) -> None:
    monitor = HealthMonitor(pool, http, interval_s=1.0, failures_to_remove=2)
    for _ in range(rounds):
        asyncio.run(monitor.check_all())


def test_a_stalled_only_prefill_stays_in_rotation():
    pool = ServerPool([PrefillEndpoint("http://p1", 1)], [], ["http://m"])
    poll(pool, ScriptedHealth({"http://p1": [HEALTH_STALLED] * 3, "http://m": [HEALTH_OK] * 3}), 3)
    (prefill,) = pool.by_role[PREFILL]
    assert prefill.healthy and prefill.consecutive_failures == 3


def test_an_unreachable_only_prefill_leaves_and_returns_on_success():
    pool = ServerPool([PrefillEndpoint("http://p1", 1)], [], ["http://m"])
    http = ScriptedHealth({"http://p1": [HEALTH_UNREACHABLE, HEALTH_UNREACHABLE, HEALTH_OK],
                           "http://m": [HEALTH_OK] * 3})
    poll(pool, http, 2)
    (prefill,) = pool.by_role[PREFILL]
    assert not prefill.healthy
    poll(pool, http, 1)
    assert prefill.healthy and prefill.consecutive_failures == 0


def test_a_stalled_prefill_leaves_while_another_one_serves():
    pool = ServerPool([PrefillEndpoint("http://p1", 1), PrefillEndpoint("http://p2", 2)], [], ["http://m"])
    poll(pool, ScriptedHealth({"http://p1": [HEALTH_STALLED] * 2, "http://p2": [HEALTH_OK] * 2,
                               "http://m": [HEALTH_OK] * 2}), 2)
    p1, p2 = pool.by_role[PREFILL]
    assert not p1.healthy and p2.healthy


def test_a_stalled_only_main_leaves():
    pool = ServerPool([PrefillEndpoint("http://p1", 1)], ["http://r"], ["http://m"])
    poll(pool, ScriptedHealth({"http://p1": [HEALTH_OK] * 2, "http://r": [HEALTH_OK] * 2,
                               "http://m": [HEALTH_STALLED] * 2}), 2)
    (main,) = pool.by_role[MAIN]
    assert not main.healthy


def test_a_refused_connection_takes_a_server_out_at_once():
    pool = ServerPool([PrefillEndpoint("http://p1", 1)], ["http://r"], ["http://m"])
    monitor = HealthMonitor(pool, ScriptedHealth({"http://r": [HEALTH_UNREACHABLE]}),
                            interval_s=1.0, failures_to_remove=3)
    removed = []
    monitor.on_removed.append(removed.append)
    (relay,) = pool.by_role[RELAY]
    asyncio.run(monitor._check(relay))
    assert not relay.healthy and removed == [relay]
    monitor.report_unreachable(relay)  # already out: nobody is told twice
    assert removed == [relay]


def test_a_slow_health_check_never_delays_another_servers_verdict():
    """SGLang's /health runs a one-token generation: a busy main can take the whole poll
    timeout. The relay's death must still be seen on the relay's own cadence."""
    class Stuck(ScriptedHealth):
        async def health(self, upstream, timeout_s: float = 10.0) -> str:
            if upstream.url == "http://m":
                await asyncio.Event().wait()  # main's check never answers
            script = self.scripts[upstream.url]
            return script.pop(0) if len(script) > 1 else script[0]  # the last one, from then on

    async def test():
        pool = ServerPool([PrefillEndpoint("http://p1", 1)], ["http://r"], ["http://m"])
        http = Stuck({"http://p1": [HEALTH_OK],
                      "http://r": [HEALTH_OK, HEALTH_OK, HEALTH_UNREACHABLE]})
        monitor = HealthMonitor(pool, http, interval_s=0.0, failures_to_remove=2)
        gone = asyncio.Event()
        monitor.on_removed.append(lambda upstream: gone.set())
        monitor.start()
        try:
            await asyncio.wait_for(gone.wait(), 30)  # a guard: it takes three polls
        finally:
            await monitor.stop()
        assert not pool.by_role[RELAY][0].healthy and pool.by_role[MAIN][0].healthy

    asyncio.run(test())


def test_a_probe_checks_a_server_now():
    async def test():
        pool = ServerPool([PrefillEndpoint("http://p1", 1)], ["http://r"], ["http://m"])
        monitor = HealthMonitor(pool, ScriptedHealth({"http://r": [HEALTH_UNREACHABLE]}),
                                interval_s=3600.0, failures_to_remove=2)
        gone = asyncio.Event()
        monitor.on_removed.append(lambda upstream: gone.set())
        (relay,) = pool.by_role[RELAY]
        monitor.probe(relay)
        monitor.probe(relay)  # one probe at a time: the script has one answer
        await asyncio.wait_for(gone.wait(), 30)
        assert not relay.healthy

    asyncio.run(test())


def test_the_client_tells_a_closed_port_from_a_dropped_connection():
    """A refusal means nothing listens (out at once); a connection dropped mid-answer may be a
    pooled one the server just closed, so it counts as one failure, not as a verdict."""
    async def test():
        async def drop(reader, writer):
            await reader.readline()
            writer.close()

        dropping = await asyncio.start_server(drop, "127.0.0.1", 0)
        dropping_port = dropping.sockets[0].getsockname()[1]
        closed = free_port()  # nothing listens there
        client = UpstreamClient(connect_timeout_s=5.0, read_timeout_s=5.0, keepalive_s=4.0)
        await client.start()
        try:
            gone = Upstream(RELAY, f"http://127.0.0.1:{closed}")
            dropped = Upstream(RELAY, f"http://127.0.0.1:{dropping_port}")
            assert await client.health(gone) == HEALTH_UNREACHABLE
            assert await client.health(dropped) == HEALTH_STALLED
            with pytest.raises(UpstreamError) as refused:
                await client.stream_into(gone, {"input_ids": [1]}, lambda chunk: None)
            assert refused.value.refused and refused.value.cause == "upstream_connection"
            with pytest.raises(UpstreamError) as reset:
                await client.stream_into(dropped, {"input_ids": [1]}, lambda chunk: None)
            assert not reset.value.refused and reset.value.cause == "upstream_connection"
        finally:
            await client.close()
            dropping.close()
            await dropping.wait_closed()

    asyncio.run(test())
