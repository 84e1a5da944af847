"""The router checks each server's actual PDD role at start and on every health poll (issue 26,
item 2): a server in the wrong list, or without a role, is refused with a message naming its
URL, the role it has and the role it was given. Its TP size is checked alike (issues 23, 37):
roles may run different sizes where SGLang's PD pairs them (one divides the other); a size that
does not pair is refused naming both servers and both sizes."""

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


def test_a_servers_capacity_is_its_schedulers_effective_limit_when_the_argument_is_unset():
    """SGLang's /server_info has ``max_running_requests`` None unless it was given; the limit the
    scheduler runs with is in its internal state. Read as 1, one request made a relay 'full'."""
    relay = Upstream(RELAY, "http://10.1.0.3:30000")
    relay.learn({"pdd_role": "relay", "max_running_requests": None,
                 "internal_states": [{"effective_max_running_requests_per_dp": 2048}]})
    assert relay.max_running_requests == 2048
    relay.learn({"pdd_role": "relay", "max_running_requests": 16,
                 "internal_states": [{"effective_max_running_requests_per_dp": 2048}]})
    assert relay.max_running_requests == 16  # the operator's own limit wins
    relay.learn({"pdd_role": "relay"})
    assert relay.max_running_requests == 1


# ---- TP size (issues 23, 37): sizes SGLang's PD pairs, per role ----------------------------------
class ScriptedServers:
    """/health always OK; /server_info from ``infos`` (url -> dict), changed by the test."""

    def __init__(self, infos: dict):
        self.infos = infos

    async def healthy(self, upstream, timeout_s=10.0):
        return True

    async def health(self, upstream, timeout_s: float = 10.0) -> str:
        return HEALTH_OK

    async def get_json(self, upstream, path, timeout_s=30.0):
        assert path == "/server_info"
        return dict(self.infos[upstream.url])


def _service(infos: dict, prefills=("http://p",), relays=("http://r",), mains=("http://m",)):
    from types import SimpleNamespace

    from pdd_sglang.router.service import RouterService

    config = SimpleNamespace(prefills=[PrefillEndpoint(url, 1) for url in prefills],
                             relays=list(relays), mains=list(mains), startup_timeout_s=5.0)
    service = RouterService.__new__(RouterService)
    service.config = config
    service.pool = ServerPool(config.prefills, config.relays, config.mains)
    service.client = ScriptedServers(infos)
    return service


def _infos(p: int, r: int, m: int) -> dict:
    return {"http://p": {"pdd_role": "prefill", "tp_size": p},
            "http://r": {"pdd_role": "relay", "tp_size": r},
            "http://m": {"pdd_role": "main", "tp_size": m}}


WHY = ("SGLang's PD pairs prefill and decode ranks by whole ratios, so one TP size must divide "
       "the other")


@pytest.mark.parametrize("sizes", [(1, 1, 2), (2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 1, 2),
                                   (1, 2, 2), (2, 4, 8), (8, 2, 4), (4, 4, 4)])
def test_mixed_tp_sizes_that_pair_start(sizes):
    """Issue 37: prefill, relay and main at different TP sizes, as SGLang's PD pairs them."""
    service = _service(_infos(*sizes))
    asyncio.run(service._wait_for_servers())
    assert all(u.healthy and u.role_error is None for u in service.pool.all())
    assert [u.tp_size for u in service.pool.all()] == list(sizes)


@pytest.mark.parametrize("sizes, refused", [
    ((2, 3, 2), ["http://r (relay) runs --tp-size 3, but the prefill http://p runs --tp-size 2"]),
    ((4, 6, 3), ["http://r (relay) runs --tp-size 6, but the prefill http://p runs --tp-size 4",
                 "http://m (main) runs --tp-size 3, but the prefill http://p runs --tp-size 4"]),
])
def test_the_router_refuses_to_start_beside_a_decode_whose_tp_size_does_not_pair(sizes, refused):
    service = _service(_infos(*sizes))
    with pytest.raises(RuntimeError) as err:
        asyncio.run(service._wait_for_servers())
    assert str(err.value) == "refusing to start: " + "; ".join(
        f"{r}: {WHY}; restart it with a --tp-size that divides {sizes[0]} or that {sizes[0]} "
        "divides" for r in refused)


def test_a_decode_is_checked_against_every_prefill():
    infos = {**_infos(2, 2, 2), "http://p2": {"pdd_role": "prefill", "tp_size": 3}}
    service = _service(infos, prefills=("http://p", "http://p2"))
    with pytest.raises(RuntimeError, match=r"http://r \(relay\) runs --tp-size 2, but the "
                                           r"prefill http://p2 runs --tp-size 3: SGLang's PD"):
        asyncio.run(service._wait_for_servers())


@pytest.mark.parametrize("infos", [_infos(2, 2, 2), _infos(1, 1, 1),
                                   {u: {"pdd_role": i["pdd_role"]}  # no tp_size: not checked
                                    for u, i in _infos(1, 3, 4).items()}])
def test_sizes_that_pair_or_are_unknown_start(infos):
    service = _service(infos)
    asyncio.run(service._wait_for_servers())
    assert all(u.healthy and u.role_error is None for u in service.pool.all())
    size = infos["http://p"].get("tp_size")
    assert service.pool.prefill_tp == ({"http://p": size} if size else {})


def test_a_wrong_role_is_reported_as_such_not_as_a_tp_size():
    infos = _infos(2, 3, 2)
    infos["http://r"]["pdd_role"] = "main"
    service = _service(infos)
    with pytest.raises(RuntimeError) as err:
        asyncio.run(service._wait_for_servers())
    assert "http://r runs --pdd-role main" in str(err.value)
    assert "--tp-size" not in str(err.value)


def test_a_poll_takes_out_a_server_whose_tp_size_no_longer_pairs_and_returns_it(caplog):
    infos = _infos(2, 2, 2)
    service = _service(infos)
    asyncio.run(service._wait_for_servers())
    monitor = HealthMonitor(service.pool, service.client, interval_s=1.0, failures_to_remove=2)
    monitor.check_role = service._check_role
    monitor.on_recovered = service._recovered
    removed = []
    monitor.on_removed.append(removed.append)
    (prefill,), (main,) = service.pool.by_role[PREFILL], service.pool.by_role[MAIN]

    infos["http://m"]["tp_size"] = 1  # main restarted at a size that pairs: stays
    asyncio.run(monitor._check(main))
    assert main.healthy and main.role_error is None and main.tp_size == 1
    infos["http://m"]["tp_size"] = 3  # ... and at one that does not
    with caplog.at_level("ERROR", logger="pdd_sglang.router"):
        asyncio.run(monitor._check(main))
        asyncio.run(monitor._check(main))  # still wrong: refused once, logged once
    assert not main.healthy and removed == [main] and service.pool.healthy(MAIN) == []
    assert main.role_error == (f"http://m (main) runs --tp-size 3, but the prefill http://p runs "
                               f"--tp-size 2: {WHY}; restart it with a --tp-size that divides 2 "
                               "or that 2 divides")
    assert [r.message for r in caplog.records].count(f"refused: {main.role_error}") == 1
    infos["http://m"]["tp_size"] = 4
    asyncio.run(monitor._check(main))
    assert main.healthy and main.role_error is None

    infos["http://p"]["tp_size"] = 3  # the prefill restarted at a size the relay cannot pair
    asyncio.run(monitor._check(prefill))
    assert not prefill.healthy and removed == [main, prefill]
    assert prefill.role_error.startswith("http://p (prefill) runs --tp-size 3, but the relay "
                                         "http://r runs --tp-size 2")
    infos["http://p"]["tp_size"] = 1  # pairs with the relay's 2 and the main's 4
    asyncio.run(monitor._check(prefill))
    assert prefill.healthy and prefill.role_error is None


def test_a_server_down_at_start_is_checked_when_it_returns():
    infos = _infos(2, 2, 2)
    service = _service(infos)
    down = {"http://r"}
    healthy = service.client.healthy

    async def maybe_healthy(upstream, timeout_s=10.0):
        return upstream.url not in down and await healthy(upstream, timeout_s)

    service.client.healthy = maybe_healthy
    service.config.startup_timeout_s = 0.01
    asyncio.run(service._wait_for_servers())
    (relay,) = service.pool.by_role[RELAY]
    assert not relay.healthy and service.pool.prefill_tp == {"http://p": 2}
    down.clear()
    infos["http://r"]["tp_size"] = 3
    monitor = HealthMonitor(service.pool, service.client, interval_s=1.0, failures_to_remove=2)
    monitor.check_role = service._check_role
    monitor.on_recovered = service._recovered
    asyncio.run(monitor._check(relay))
    assert not relay.healthy and "http://r (relay) runs --tp-size 3" in relay.role_error
    infos["http://r"]["tp_size"] = 1
    asyncio.run(monitor._check(relay))
    assert relay.healthy and relay.role_error is None


def test_the_health_view_and_metrics_show_each_servers_tp_size():
    from pdd_sglang.router.metrics import RouterMetrics

    service = _service(_infos(1, 1, 2))
    asyncio.run(service._wait_for_servers())
    assert service.pool.health_view() == [
        {"role": role, "url": url, "healthy": True, "wan_out": False, "tp_size": tp,
         "refused": None}
        for role, url, tp in ((PREFILL, "http://p", 1), (RELAY, "http://r", 1),
                              (MAIN, "http://m", 2))]
    text = RouterMetrics().render(service.pool).decode()
    assert 'pdd_router_server_tp_size{role="main",url="http://m"} 2.0' in text
    assert 'pdd_router_server_tp_size{role="prefill",url="http://p"} 1.0' in text


def test_a_refused_start_closes_the_router_s_http_session():
    service = _service(_infos(2, 3, 2))
    calls = []
    service.client.start = lambda: _note(calls, "start")
    service.client.close = lambda: _note(calls, "close")
    with pytest.raises(RuntimeError, match="refusing to start"):
        asyncio.run(service.start())
    assert calls == ["start", "close"]


async def _note(calls, what):
    calls.append(what)
