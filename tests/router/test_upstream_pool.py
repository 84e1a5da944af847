"""The router's connection pool to its servers (router/upstream.py): the connection released
last is the next one taken, so a burst's extra connections idle out while steady traffic keeps
reusing the same few. router/http1.py's pool against a local aiohttp server; seconds."""

from __future__ import annotations

import asyncio

from aiohttp import web

from pdd_sglang.dev.testing.cluster import free_port
from pdd_sglang.router.servers import Upstream
from pdd_sglang.router.upstream import UpstreamClient


def test_the_connection_released_last_is_reused_first():
    async def scenario():
        peers: list = []

        async def answer(request):
            peers.append(request.transport.get_extra_info("peername"))
            await asyncio.sleep(0.05)
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_get("/server_info", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        client = UpstreamClient(connect_timeout_s=5.0, read_timeout_s=5.0, keepalive_s=4.0)
        await client.start()
        server = Upstream(role="prefill", url=f"http://127.0.0.1:{port}")
        try:
            # A burst opens four connections; then one request at a time.
            await asyncio.gather(*(client.get_json(server, "/server_info") for _ in range(4)))
            burst = set(peers)
            assert len(burst) == 4
            for _ in range(6):
                await client.get_json(server, "/server_info")
            steady = peers[4:]
            # A pool taking the oldest first (aiohttp's) would go round all four; this one takes
            # the one released last.
            assert len(set(steady)) == 1 and steady[0] in burst, steady
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(scenario())
