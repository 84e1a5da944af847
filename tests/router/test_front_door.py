"""The router's front door against scripted servers that check keys as SGLang does: a request
without the key is refused before any server sees it, the router sends the servers' keys on every
call, the admin key alone flushes, internal detail only for the operator, and readiness apart
from liveness."""

from __future__ import annotations

import asyncio
import json
import ssl

import aiohttp
import pytest
from aiohttp import web

from pdd_sglang.dev.testing.cluster import free_port
from pdd_sglang.dev.testing.tls import make_pki
from pdd_sglang.dev.testing.tiny_model import ensure_tiny_model
from pdd_sglang.router.app import build_app
from pdd_sglang.router.config import LinkParams, PrefillEndpoint, RouterConfig, parse_args
from pdd_sglang.router.front_door import listener_tls
from pdd_sglang.router.service import RouterService

from test_router_app import MAIN_SCRIPT, RELAY_SCRIPT, FakeServer, sse

KEY, ADMIN = "client-key", "admin-key"
SERVER_KEY, SERVER_ADMIN = "server-key", "server-admin-key"
BODY = {"input_ids": list(range(4, 60)), "sampling_params": {"max_new_tokens": 5}}


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def keyed_router(test, start_servers: bool = True, model_path: str = "",
                       server_tls=None, client_tls=None, **settings):
    """Servers with SGLang's keys on, a router with ``settings`` (keys on unless given);
    ``model_path``: what the servers say they serve (default: the tiny model); ``server_tls``:
    the servers' TLS; ``client_tls``: the test client's, to a router serving TLS."""
    model_path = model_path or str(ensure_tiny_model())
    keyed = dict(api_key=SERVER_KEY, admin_api_key=SERVER_ADMIN, ssl_context=server_tls)
    servers = [FakeServer("prefill", model_path, **keyed),
               FakeServer("relay", model_path, RELAY_SCRIPT, **keyed),
               FakeServer("main", model_path, MAIN_SCRIPT, **keyed)]
    prefill, relay, main = servers
    keys = dict(api_key=KEY, admin_api_key=ADMIN, server_api_key=SERVER_KEY,
                server_admin_api_key=SERVER_ADMIN)
    config = RouterConfig(prefills=(PrefillEndpoint(prefill.url, 9999),), relays=(relay.url,),
                          mains=(main.url,), link=LinkParams(1.0, 0.0), health_interval_s=0.2,
                          **{**keys, **settings})
    if start_servers:
        for server in servers:
            await server.start()
    service = RouterService(config)
    runner = web.AppRunner(build_app(service), handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=listener_tls(config)).start()
    scheme = "https" if config.ssl_certfile else "http"
    try:
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=client_tls if client_tls else True)) as session:
            await test(session, f"{scheme}://127.0.0.1:{port}", service, servers)
    finally:
        await runner.cleanup()
        for server in servers:
            if server.runner is not None:
                await server.stop()


def test_a_request_without_the_key_is_refused_before_any_server_sees_it():
    async def test(session, url, service, servers):
        await service.starting
        for headers in ({}, auth("wrong"), {"Authorization": KEY}):
            async with session.post(url + "/generate", json=BODY, headers=headers) as resp:
                assert resp.status == 401 and await resp.json() == {"error": "Unauthorized"}
            async with session.post(url + "/v1/completions", headers=headers,
                                    json={"prompt": "w1 w2", "max_tokens": 2}) as resp:
                assert resp.status == 401
        assert all(not s.bodies for s in servers)
        # Probes and scrapes need no key, as on SGLang.
        for path in ("/health", "/ready", "/metrics"):
            async with session.get(url + path) as resp:
                assert resp.status == 200, path
        async with session.post(url + "/generate", json=BODY, headers=auth(KEY)) as resp:
            assert resp.status == 200
            assert (await resp.json())["output_ids"] == [10, 11, 12, 13, 14]
        # Every call the router made carried the servers' key: none refused.
        assert [s.refused for s in servers] == [[], [], []]
        assert all(s.bodies for s in servers)
    asyncio.run(keyed_router(test))


def test_the_router_s_calls_fail_without_the_servers_key():
    async def test(session, url, service, servers):
        with pytest.raises(RuntimeError, match="no prefill server answered"):
            await service.starting
        assert all("/server_info" in s.refused for s in servers)
    asyncio.run(keyed_router(test, server_api_key=None, startup_timeout_s=0.5))


def test_only_the_admin_key_flushes():
    async def test(session, url, service, servers):
        await service.starting
        for key in (None, KEY, "wrong"):
            headers = auth(key) if key else {}
            async with session.post(url + "/flush_cache", headers=headers) as resp:
                assert resp.status == 401, key
        assert all(s.flushed == 0 for s in servers)
        async with session.post(url + "/flush_cache", headers=auth(ADMIN)) as resp:
            assert resp.status == 200
        # ... sent to each server with its admin key (their api key alone would be refused).
        assert [s.flushed for s in servers] == [1, 1, 1]
        assert [s.refused for s in servers] == [[], [], []]
    asyncio.run(keyed_router(test))


def _urls(servers) -> list[str]:
    return [s.url for s in servers] + [f"127.0.0.1:{s.port}" for s in servers]


def test_answers_carry_no_internal_detail_unless_the_admin_asks():
    async def test(session, url, service, servers):
        await service.starting
        seen = []
        async with session.post(url + "/generate", json=BODY, headers=auth(KEY)) as resp:
            whole = await resp.json()
            seen.append(json.dumps(whole))
        assert "pdd" not in whole["meta_info"]
        async with session.post(url + "/generate", json={**BODY, "stream": True},
                                headers=auth(KEY)) as resp:
            chunks = await sse(resp)
            seen.append(json.dumps(chunks))
        assert all("pdd" not in c["meta_info"] for c in chunks)
        async with session.post(url + "/v1/completions", headers=auth(KEY),
                                json={"prompt": "w1 w2", "max_tokens": 5}) as resp:
            completion = await resp.json()
            seen.append(json.dumps(completion))
        assert "metadata" not in completion and completion["choices"][0]["text"]
        for path in ("/ready", "/server_info", "/metrics"):
            async with session.get(url + path, headers=auth(KEY)) as resp:
                seen.append(await resp.text())
        assert "main-0" in seen[-1] and "relay-0" in seen[-2] and "prefill-0" in seen[-3]
        for text in seen:
            assert not any(u in text for u in _urls(servers)), text
        # The operator's key shows them.
        async with session.post(url + "/generate", json=BODY, headers=auth(ADMIN)) as resp:
            pdd = (await resp.json())["meta_info"]["pdd"]
        assert pdd["main"] == servers[2].url and "marks" in pdd
        for path in ("/ready", "/server_info", "/metrics"):
            async with session.get(url + path, headers=auth(ADMIN)) as resp:
                assert servers[2].url in await resp.text(), path
    asyncio.run(keyed_router(test))


def test_the_operator_setting_shows_internal_detail_to_every_client():
    async def test(session, url, service, servers):
        await service.starting
        async with session.post(url + "/v1/completions", headers=auth(KEY),
                                json={"prompt": "w1 w2", "max_tokens": 5}) as resp:
            assert (await resp.json())["metadata"]["pdd"]["main"] == servers[2].url
    asyncio.run(keyed_router(test, expose_internal_details=True))


def test_the_router_listens_at_once_and_is_ready_once_its_servers_are():
    async def test(session, url, service, servers):
        async with session.get(url + "/health") as resp:
            assert resp.status == 200 and (await resp.json())["ready"] is False
        async with session.get(url + "/ready") as resp:
            assert resp.status == 503
        async with session.post(url + "/generate", json=BODY, headers=auth(KEY)) as resp:
            assert resp.status == 503  # not served yet, and no server reached
        for server in servers:
            await server.start()
        await asyncio.wait_for(service.starting, 30)
        async with session.get(url + "/ready") as resp:
            assert resp.status == 200
        # No main in rotation: not ready, still alive.
        await servers[2].stop()
        for _ in range(100):
            async with session.get(url + "/ready") as resp:
                if resp.status == 503:
                    break
            await asyncio.sleep(0.1)
        assert resp.status == 503
        async with session.get(url + "/health") as resp:
            assert resp.status == 200
        servers[2].runner = None  # stopped here
    asyncio.run(keyed_router(test, start_servers=False))


def test_keys_come_from_the_environment_and_stay_out_of_the_config_s_repr(monkeypatch):
    monkeypatch.setenv("PDD_ROUTER_API_KEY", KEY)
    monkeypatch.setenv("PDD_SERVER_API_KEY", SERVER_KEY)
    config = parse_args(["--prefill", "http://p", "--main", "http://m"])
    assert (config.api_key, config.server_api_key, config.admin_api_key) == (KEY, SERVER_KEY,
                                                                             None)
    assert KEY not in repr(config) and SERVER_KEY not in repr(config)
    # A flag given wins over the environment.
    assert parse_args(["--prefill", "http://p", "--main", "http://m", "--api-key",
                       "other"]).api_key == "other"


def test_a_router_that_cannot_learn_the_model_refuses_to_start_naming_what(tmp_path):
    """Main's /server_info without PDD's KV figure, and a model path the router cannot read:
    no assumed size, a refusal that names it (and --kv-bytes-per-token)."""
    tokenizer_dir = str(ensure_tiny_model())

    async def test(session, url, service, servers):
        with pytest.raises(RuntimeError) as refusal:
            await service.starting
        message = str(refusal.value)
        assert "KV bytes per token" in message and "--kv-bytes-per-token" in message
        assert "context length" in message and str(tmp_path) in message
        async with session.get(url + "/ready") as resp:
            assert resp.status == 503 and "KV bytes per token" in (await resp.json())["error"]

    # No config.json at the model path the servers name.
    asyncio.run(keyed_router(test, model_path=str(tmp_path), tokenizer_path=tokenizer_dir))


def test_the_servers_kv_figure_is_what_the_router_places_with():
    from pdd_sglang.router.model import load_model_info
    info = {"internal_states": [{"pdd": {"kv_bytes_per_token": 3072.0,
                                         "context_length": 2048}}]}
    model = load_model_info({"model_path": "/nowhere"}, info, str(ensure_tiny_model()), None,
                            False)
    assert (model.kv_bytes_per_token, model.context_length) == (3072.0, 2048)
    # The operator's figure wins.
    assert load_model_info({"model_path": "/nowhere"}, info, str(ensure_tiny_model()),
                           512.0, False).kv_bytes_per_token == 512.0


def _tls(tmp_path):
    """A test CA; servers that present its certificate and demand the client's."""
    pki = make_pki(tmp_path / "pki")
    servers = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=pki.ca_file)
    servers.load_cert_chain(pki.server.certfile, pki.server.keyfile)
    servers.verify_mode = ssl.CERT_REQUIRED
    return pki, servers


def test_the_router_reaches_keyed_servers_over_tls_with_a_ca_bundle_and_a_client_cert(tmp_path):
    """Servers on TLS that demand a client certificate and their key; the router serving TLS
    itself: the whole path encrypted, each leg verified against the test's CA."""
    pki, servers_tls = _tls(tmp_path)
    client = ssl.create_default_context(cafile=pki.ca_file)

    async def test(session, url, service, servers):
        await service.starting
        async with session.post(url + "/generate", json=BODY, headers=auth(KEY)) as resp:
            assert resp.status == 200
            assert (await resp.json())["output_ids"] == [10, 11, 12, 13, 14]
        assert all(s.bodies for s in servers) and [s.refused for s in servers] == [[], [], []]
        async with session.post(url + "/flush_cache", headers=auth(ADMIN)) as resp:
            assert resp.status == 200
        # A client that does not trust the test's CA cannot talk to the router.
        async with aiohttp.ClientSession() as untrusting:
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await untrusting.get(url + "/health")
    asyncio.run(keyed_router(
        test, server_tls=servers_tls, client_tls=client, server_ssl_ca_certs=pki.ca_file,
        server_ssl_certfile=pki.client.certfile, server_ssl_keyfile=pki.client.keyfile,
        ssl_certfile=pki.server.certfile, ssl_keyfile=pki.server.keyfile))


def test_without_the_ca_bundle_or_the_client_cert_the_router_reaches_no_server(tmp_path):
    pki, servers_tls = _tls(tmp_path)
    for settings in ({}, {"server_ssl_ca_certs": pki.ca_file}):  # system CAs; no client cert
        async def test(session, url, service, servers):
            with pytest.raises(RuntimeError, match="no prefill server answered"):
                await service.starting
            assert not any(s.bodies for s in servers)
        asyncio.run(keyed_router(test, server_tls=servers_tls, startup_timeout_s=0.5,
                                 **settings))


def test_a_failure_told_to_a_client_names_servers_by_role():
    from pdd_sglang.router.front_door import without_addresses
    from pdd_sglang.router.servers import ServerPool
    pool = ServerPool((PrefillEndpoint("http://10.0.0.11:30000"),), ("http://10.0.0.12:30000",),
                      ("https://md1.example:8443",))
    message = ("main server failed: ConnectError('cannot connect to md1.example:8443: refused') "
               "after the relay http://10.0.0.12:30000 and prefill 10.0.0.11:30000")
    told = without_addresses(message, pool)
    assert told == ("main server failed: ConnectError('cannot connect to main-0: refused') "
                    "after the relay relay-0 and prefill prefill-0")
