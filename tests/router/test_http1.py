"""The router's HTTP/1.1 client (router/http1.py) against scripted servers: the answer's framing
wherever the bytes split, the pool's keep-alive rules, and the failures mapped as
router/upstream.py's callers expect them. Local sockets only; seconds."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from pdd_sglang.dev.testing.cluster import free_port
from pdd_sglang.router.http1 import BadResponse, Connection, HttpStatusError, Pool
from pdd_sglang.router.servers import HEALTH_OK, HEALTH_UNREACHABLE, Upstream
from pdd_sglang.router.upstream import UpstreamClient, UpstreamError


def _sse(*events: bytes) -> bytes:
    """A chunked stream, one chunk per SSE event, as SGLang's uvicorn writes it."""
    out = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    for event in events:
        out += b"%x\r\n%s\r\n" % (len(event), event)
    return out + b"0\r\n\r\n"


def _json(payload: dict, status: int = 200, extra: bytes = b"") -> bytes:
    body = orjson.dumps(payload)
    return (b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
            % (status, len(body), extra, body))


def _chunk(k: int, last: bool = False) -> bytes:
    meta = {"finish_reason": {"type": "length"} if last else None}
    return b"data: " + orjson.dumps({"text": f"w{k}", "output_ids": [k], "meta_info": meta}) \
        + b"\n\n"


class FakeTransport:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed


STREAM = _sse(_chunk(1), _chunk(2) + _chunk(3), _chunk(4, last=True), b"data: [DONE]\n\n")


@pytest.mark.parametrize("step", [1, 2, 3, 7, 64, len(STREAM)])
def test_a_chunked_stream_reads_the_same_events_wherever_its_bytes_split(step):
    async def scenario():
        pool = Pool(connect_timeout_s=1.0, keepalive_s=1.0)
        conn = Connection(pool, ("h", 1, False))
        conn.connection_made(FakeTransport())
        for start in range(0, len(STREAM), step):
            conn.data_received(STREAM[start:start + step])
        assert await conn.head(None) == 200
        events = []
        await conn.read_events(lambda event: events.append(event) or False, 1 << 20)
        return events, conn

    events, conn = asyncio.run(scenario())
    assert events == [_chunk(1), _chunk(2), _chunk(3), _chunk(4, last=True), b"data: [DONE]\n\n"]
    assert conn.body_done and conn.keep_alive and conn.error is None


def test_a_broken_chunk_fails_the_read():
    async def scenario():
        conn = Connection(Pool(1.0, 1.0), ("h", 1, False))
        conn.connection_made(FakeTransport())
        conn.data_received(_sse()[:-len(b"0\r\n\r\n")] + b"zz\r\ndata\r\n")  # size not hex
        with pytest.raises(BadResponse):
            await conn.read(None)
        assert conn.transport.closed

    asyncio.run(scenario())


class Script:
    """A server that answers each request with the next scripted reply (bytes, or None: close
    the connection without answering), and counts the connections it accepted."""

    def __init__(self, replies: list):
        self.replies = list(replies)
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.requests.append(head + await reader.readexactly(length))
                reply = self.replies.pop(0)
                if reply is None:
                    break
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client += 1
        writer.close()

    async def start(self) -> Upstream:
        port = free_port()
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", port)
        return Upstream("main", f"http://127.0.0.1:{port}")


def _run(replies: list, body, keepalive_s: float = 4.0):
    async def scenario():
        script = Script(replies)
        upstream = await script.start()
        client = UpstreamClient(connect_timeout_s=2.0, read_timeout_s=5.0, keepalive_s=keepalive_s)
        await client.start()
        try:
            return await body(client, upstream, script), script
        finally:
            await client.close()
            script.server.close()

    return asyncio.run(scenario())


def test_answers_read_whole_reuse_one_connection_until_the_keepalive_passes():
    async def body(client, upstream, script):
        assert await client.generate_final(upstream, {"rid": "a"}) == {"ok": 1}
        chunks = []
        await client.stream_into(upstream, {"rid": "b"}, chunks.append)
        assert [c.text for c in chunks] == ["w1", "w2", "w3", "w4"] and chunks[-1].finished
        assert script.connections == 1
        await asyncio.sleep(0.4)  # past the keep-alive: a new connection
        assert await client.get_json(upstream, "/server_info") == {"ok": 3}
        return script.connections

    connections, script = _run([_json({"ok": 1}), STREAM, _json({"ok": 3})], body,
                               keepalive_s=0.3)
    assert connections == 2
    assert b'"stream":true' in script.requests[1] and script.requests[1].startswith(
        b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:")


def test_a_server_that_says_close_gets_a_new_connection_next_time():
    async def body(client, upstream, script):
        await client.get_json(upstream, "/a")
        await client.get_json(upstream, "/b")
        return script.connections

    connections, _ = _run([_json({}, extra=b"connection: close\r\n"), _json({})], body)
    assert connections == 2


def test_a_stream_left_mid_answer_closes_its_connection():
    half = _sse(_chunk(1))[:-len(b"0\r\n\r\n")]  # one event, then nothing more

    async def body(client, upstream, script):
        first = asyncio.get_running_loop().create_future()
        stream = asyncio.create_task(client.stream_into(upstream, {"rid": "a"},
                                                        first.set_result))
        assert (await first).text == "w1"
        stream.cancel()  # the client went away: the pump stops reading
        with pytest.raises(asyncio.CancelledError):
            await stream
        await asyncio.sleep(0.1)
        assert await client.generate_final(upstream, {"rid": "b"}) == {"ok": 2}
        return script.connections

    connections, script = _run([half, _json({"ok": 2})], body)
    assert connections == 2 and script.closed_by_client == 1


def test_a_stream_that_ended_in_an_abort_chunk_hands_its_whole_answer_back_to_the_pool():
    # A PDD main letting its copy go (its relay answered alone): one abort chunk, then [DONE].
    meta = {"finish_reason": {"type": "abort", "message": "finished_at_relay"}}
    aborted = _sse(b"data: " + orjson.dumps({"text": "", "output_ids": [], "meta_info": meta})
                   + b"\n\n", b"data: [DONE]\n\n")

    async def body(client, upstream, script):
        with pytest.raises(UpstreamError) as failed:
            await client.stream_into(upstream, {"rid": "a"}, lambda chunk: None)
        assert failed.value.cause == "upstream_abort"
        assert await client.generate_final(upstream, {"rid": "b"}) == {"ok": 2}
        return script.connections

    connections, script = _run([aborted, _json({"ok": 2})], body)
    assert connections == 1 and script.closed_by_client == 0


def test_a_get_is_sent_again_when_its_reused_connection_was_closed_but_a_post_is_not():
    async def body(client, upstream, script):
        await client.get_json(upstream, "/a")
        # The server drops the reused connection as the request arrives: the GET goes again.
        assert await client.get_json(upstream, "/b") == {"ok": 2}
        assert script.connections == 2
        with pytest.raises(UpstreamError) as err:
            await client.generate_final(upstream, {"rid": "c"})
        return err.value

    err, _ = _run([_json({"ok": 1}), None, _json({"ok": 2}), None], body)
    assert err.cause == "upstream_connection" and not err.refused


def test_failures_map_as_the_callers_expect():
    async def body(client, upstream, script):
        with pytest.raises(HttpStatusError) as missing:
            await client.get_bytes(upstream, "/pdd/line")
        assert missing.value.status == 404  # router/line_state.py reads .status
        with pytest.raises(UpstreamError) as refused_status:
            await client.generate_final(upstream, {"rid": "a"})
        assert (refused_status.value.cause, refused_status.value.status) == (
            "upstream_status", 503)
        assert "busy" in refused_status.value.message
        assert await client.health(upstream) == HEALTH_OK
        gone = Upstream("main", f"http://127.0.0.1:{free_port()}")
        assert await client.health(gone) == HEALTH_UNREACHABLE
        with pytest.raises(UpstreamError) as refused:
            await client.generate_final(gone, {"rid": "b"})
        return refused.value

    replies = [_json({}, 404), _json({"error": {"message": "busy"}}, 503), _json({})]
    err, _ = _run(replies, body)
    assert err.cause == "upstream_connection" and err.refused
