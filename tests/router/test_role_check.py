"""The router checks each server's actual PDD role at start and on every health poll (issue 26,
item 2): a server in the wrong list, or without a role, is refused with a message naming its
URL, the role it has and the role it was given."""

from __future__ import annotations

import asyncio

import pytest

from pdd_sglang.router.config import PrefillEndpoint
from pdd_sglang.router.servers import (HEALTH_OK, MAIN, PREFILL, RELAY, HealthMonitor,
                                       ServerPool, Upstream, role_mismatch)


@pytest.mark.parametrize("given, actual", [(PREFILL, PREFILL), (RELAY, RELAY), (MAIN, MAIN)])
def test_the_right_role_passes(given, actual):
    assert role_mismatch(Upstream(given, "http://s:1"), {"pdd_role": actual}) is None


@pytest.mark.parametrize("given, actual, listed_under", [
    (RELAY, MAIN, "--main"), (MAIN, RELAY, "--relay"), (PREFILL, MAIN, "--main"),
    (MAIN, PREFILL, "--prefill")])
def test_a_server_in_the_wrong_list_is_named_with_both_roles(given, actual, listed_under):
    message = role_mismatch(Upstream(given, "http://10.0.0.7:30001"), {"pdd_role": actual})
    assert message.startswith(f"http://10.0.0.7:30001 runs --pdd-role {actual}, but it was given "
                              f"to the router as a {given}")
    assert message.endswith(f"list it under {listed_under}")


@pytest.mark.parametrize("info", [{}, {"pdd_role": None}])
def test_a_server_without_a_role_is_refused(info):
    message = role_mismatch(Upstream(PREFILL, "http://p:2"), info)
    assert "http://p:2 runs without --pdd-role" in message
    assert "given to the router as a prefill (--prefill)" in message


class Polls:
    """/health always OK; /server_info's role from a script, one entry per poll."""

    def __init__(self, roles: dict):
        self.roles = {url: list(r) for url, r in roles.items()}

    async def health(self, upstream, timeout_s: float = 10.0) -> str:
        return HEALTH_OK


def _monitor(pool, roles):
    polls = Polls(roles)
    monitor = HealthMonitor(pool, polls, interval_s=1.0, failures_to_remove=2)

    async def check_role(upstream):
        return role_mismatch(upstream, {"pdd_role": polls.roles[upstream.url].pop(0)})

    monitor.check_role = check_role
    recovered = []

    async def on_recovered(upstream):
        recovered.append(upstream.url)
        return True

    monitor.on_recovered = on_recovered
    return monitor, recovered


def test_a_health_poll_takes_out_a_server_whose_role_changed_and_returns_it_when_right(caplog):
    pool = ServerPool([PrefillEndpoint("http://p", 1)], ["http://r"], ["http://m"])
    monitor, recovered = _monitor(pool, {"http://p": ["prefill"] * 3,
                                         "http://r": ["relay", None, None, "relay"],
                                         "http://m": ["main"] * 3})
    (relay,) = pool.by_role[RELAY]
    removed = []
    monitor.on_removed.append(removed.append)
    asyncio.run(monitor.check_all())
    assert relay.healthy and relay.role_error is None
    with caplog.at_level("ERROR", logger="pdd_sglang.router"):
        asyncio.run(monitor._check(relay))
        asyncio.run(monitor._check(relay))  # still wrong: refused once, logged once
    assert not relay.healthy and removed == [relay]
    assert "http://r runs without --pdd-role" in relay.role_error
    assert [r.message for r in caplog.records].count(f"refused: {relay.role_error}") == 1
    assert pool.healthy(RELAY) == []
    asyncio.run(monitor._check(relay))
    assert relay.healthy and relay.role_error is None and recovered == ["http://r"]


def test_the_router_refuses_to_start_beside_a_server_of_the_wrong_role(monkeypatch):
    from types import SimpleNamespace

    from pdd_sglang.router.service import RouterService

    config = SimpleNamespace(prefills=[PrefillEndpoint("http://p", 1)], relays=["http://r"],
                             mains=["http://m"], startup_timeout_s=5.0)
    service = RouterService.__new__(RouterService)
    service.config = config
    service.pool = ServerPool(config.prefills, config.relays, config.mains)
    roles = {"http://p": "prefill", "http://r": "main", "http://m": "main"}

    class Client:
        async def healthy(self, upstream, timeout_s=10.0):
            return True

        async def get_json(self, upstream, path, timeout_s=30.0):
            return {"pdd_role": roles[upstream.url]}

    service.client = Client()
    expected = (r"refusing to start: http://r runs --pdd-role main, "
                r"but it was given to the router as a relay \(--relay\)")
    with pytest.raises(RuntimeError, match=expected):
        asyncio.run(service._wait_for_servers())
    roles["http://r"] = "relay"
    service.pool = ServerPool(config.prefills, config.relays, config.mains)
    asyncio.run(service._wait_for_servers())
    assert all(u.role_error is None and u.healthy for u in service.pool.all())


def test_a_prefill_advertises_its_bootstrap_host():
    prefill = Upstream(PREFILL, "http://10.1.0.2:30000", 8998)
    prefill.learn({"pdd_role": "prefill"})
    assert prefill.bootstrap_host == "10.1.0.2"
    prefill.learn({"pdd_role": "prefill", "pdd_advertise_host": "p.dc-a.example"})
    assert prefill.bootstrap_host == "p.dc-a.example"
