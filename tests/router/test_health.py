"""The health monitor: a stall never takes out the only prefill; a dead one does. A stalled main
(e.g. behind a cut line) still leaves: the relay answers alone meanwhile."""

from __future__ import annotations

import asyncio

from pdd_sglang.router.config import PrefillEndpoint
from pdd_sglang.router.servers import (HEALTH_OK, HEALTH_STALLED, HEALTH_UNREACHABLE, MAIN,
                                       PREFILL, HealthMonitor, ServerPool)


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
