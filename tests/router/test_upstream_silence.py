"""A streamed answer that falls silent past --read-timeout-s fails as a timeout (one watch for
every stream, router/upstream.py's SilenceWatch), and a talking one is never cut."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from pdd_sglang.dev.testing.cluster import free_port
from pdd_sglang.router.servers import Upstream
from pdd_sglang.router.upstream import SilenceWatch, UpstreamClient, UpstreamError


async def _serve(pause_after: int, pause_s: float):
    async def generate(request):
        await request.read()
        response = web.StreamResponse()
        await response.prepare(request)
        for k in range(4):
            if k == pause_after:
                await asyncio.sleep(pause_s)
            finish = '{"type": "length"}' if k == 3 else "null"
            await response.write(b'data: {"text": "w", "output_ids": [%d], "meta_info": '
                                 b'{"finish_reason": %s}}\n\n' % (k, finish.encode()))
            await asyncio.sleep(0.05)
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, Upstream("main", f"http://127.0.0.1:{port}")


@pytest.mark.parametrize("pause_s, times_out", [(1.0, True), (0.0, False)])
def test_a_silent_stream_times_out_and_a_talking_one_does_not(monkeypatch, pause_s, times_out):
    monkeypatch.setattr(SilenceWatch, "PERIOD_S", 0.05)

    async def scenario():
        runner, upstream = await _serve(pause_after=2, pause_s=pause_s)
        client = UpstreamClient(connect_timeout_s=5.0, read_timeout_s=0.4, keepalive_s=4.0)
        await client.start()
        try:
            chunks = []
            await client.stream_into(upstream, {"rid": "r"}, chunks.append)
            return chunks, None
        except UpstreamError as err:
            return None, err
        finally:
            await client.close()
            await runner.cleanup()

    chunks, err = asyncio.run(scenario())
    if times_out:
        assert err is not None and err.cause == "upstream_timeout", err
        assert "no data within the read timeout" in str(err)
    else:
        assert err is None and len(chunks) == 4  # 0.2 s in all, each gap under the timeout
