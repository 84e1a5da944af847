"""HTTP to the SGLang servers: streamed /generate normalised to cumulative chunks, abort, health."""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Optional

import aiohttp
import orjson

from pdd_sglang.router.servers import HEALTH_OK, HEALTH_STALLED, HEALTH_UNREACHABLE, Upstream
from pdd_sglang.router.splice import IdsPrefix, UpstreamChunk

logger = logging.getLogger("pdd_sglang.router")


class UpstreamError(RuntimeError):
    """A server refused or broke a request. ``cause`` labels the error metric."""

    def __init__(self, upstream: Upstream, message: str, cause: str, status: Optional[int] = None,
                 refused: bool = False):
        super().__init__(f"{upstream.role} {upstream.url}: {message}")
        self.upstream = upstream
        self.cause = cause
        self.status = status
        self.message = message
        # The connection itself was refused (or had no route): nothing listens there, so the
        # server is gone, not slow; no byte of the request reached it.
        self.refused = refused


MAX_EVENT_BYTES = 64 << 20  # one SSE event of a cumulative stream holds the whole answer
# Bodies are encoded with orjson: aiohttp's json= runs the standard library's encoder, about
# half a millisecond for a 2K-token prompt's input_ids, three times a request (router bench).
_JSON = {"Content-Type": "application/json"}


class SilenceWatch:
    """The read timeout of every streamed answer, kept by one timer: a stream silent for
    ``timeout_s`` is closed, and its reader fails with "no data within the read timeout".
    aiohttp's own read timeout re-arms a timer at every chunk received, a timer per token
    relayed at hundreds of streams. Owner: the router's event loop."""

    PERIOD_S = 1.0

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._heard: dict = {}  # response -> loop time of its last data
        self._expired: set = set()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def heard(self, response) -> None:
        self._heard[response] = self._loop.time()

    def forget(self, response) -> bool:
        """Stop watching ``response``; whether it was closed for its silence."""
        self._heard.pop(response, None)
        if response in self._expired:
            self._expired.discard(response)
            return True
        return False

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.PERIOD_S)
            now = self._loop.time()
            silent = [r for r, last in self._heard.items() if now - last > self.timeout_s]
            for response in silent:
                del self._heard[response]
                self._expired.add(response)
                response.close()


class LastUsedFirstConnector(aiohttp.TCPConnector):
    """aiohttp's pool, taking the idle connection released last instead of the oldest.

    aiohttp hands out the oldest idle connection first, so after a burst every connection it
    opened stays in rotation and each idles as long as the burst's connections take to come round
    again: past the keep-alive, and each request of the next burst opens a new one (the router
    bench's 256 streams: about one prefill connection per request). Taken last-released-first,
    the connections that steady traffic needs stay warm and the rest idle out. The hook is
    aiohttp's ``_release``, whose pool is a deque per host read from its left
    (tests/router/test_upstream_pool.py holds it to that)."""

    def _release(self, key, protocol, *, should_close: bool = False) -> None:
        super()._release(key, protocol, should_close=should_close)
        conns = self._conns.get(key)
        if conns and conns[-1][0] is protocol:
            conns.rotate(1)  # the connection released just now is the next one taken


class UpstreamClient:
    def __init__(self, connect_timeout_s: float, read_timeout_s: float, keepalive_s: float):
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_s = keepalive_s
        self._session: Optional[aiohttp.ClientSession] = None
        self._timeouts: dict[Optional[float], aiohttp.ClientTimeout] = {}
        # A stream's silence is the watch's (aiohttp's per-chunk read timer is off for it).
        self._stream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        self.silences = SilenceWatch(read_timeout_s)

    async def start(self) -> None:
        # No pool limit: each in-flight request holds one stream per server. Idle pooled
        # connections are dropped before the servers' own keep-alive (SGLang's uvicorn: 5 s,
        # SGLANG_TIMEOUT_KEEP_ALIVE) closes them: reusing one the server has just closed fails
        # the request with "Server disconnected" (seen across the emulated WAN, where the race
        # window is an RTT wide). Kept as long as that allows (--upstream-keepalive-s): a burst
        # of requests that finds the pool emptied opens a connection per request and server
        # (0.2-0.5 ms of the router's CPU each, router bench).
        # No cookies and no decompression: SGLang sets neither, and both cost per response.
        self._session = aiohttp.ClientSession(connector=LastUsedFirstConnector(
            limit=0, keepalive_timeout=self.keepalive_s),
            cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False)
        self.silences.start()

    async def close(self) -> None:
        self.silences.stop()
        if self._session is not None:
            await self._session.close()

    def _timeout(self, total: Optional[float] = None) -> aiohttp.ClientTimeout:
        """One ClientTimeout per total, made once (it is a frozen attrs class: costly each
        request)."""
        timeout = self._timeouts.get(total)
        if timeout is None:
            timeout = self._timeouts[total] = aiohttp.ClientTimeout(
                total=total, sock_connect=self.connect_timeout_s, sock_read=self.read_timeout_s)
        return timeout

    async def get_json(self, upstream: Upstream, path: str, timeout_s: float = 30.0) -> dict:
        async with self._session.get(upstream.url + path,
                                     timeout=self._timeout(timeout_s)) as resp:
            resp.raise_for_status()
            return await resp.json(content_type=None)

    async def get_bytes(self, upstream: Upstream, path: str, timeout_s: float = 30.0) -> bytes:
        """The raw body, for readers that parse only what they need (router/line_state.py)."""
        async with self._session.get(upstream.url + path,
                                     timeout=self._timeout(timeout_s)) as resp:
            resp.raise_for_status()
            return await resp.read()

    async def healthy(self, upstream: Upstream, timeout_s: float = 10.0) -> bool:
        return await self.health(upstream, timeout_s) == HEALTH_OK

    async def health(self, upstream: Upstream, timeout_s: float = 10.0) -> str:
        """HEALTH_OK; HEALTH_STALLED when the server is there but did not say healthy (SGLang's
        /health answers 503 while its scheduler is busy past its own deadline), did not answer in
        time, or dropped the connection mid-answer (a pooled connection the server had just
        closed fails that way too); HEALTH_UNREACHABLE when nothing accepts the connection (the
        process is gone), which takes the server out of rotation at once."""
        try:
            async with self._session.get(upstream.url + "/health",
                                         timeout=self._timeout(timeout_s)) as resp:
                return HEALTH_OK if resp.status == 200 else HEALTH_STALLED
        except asyncio.TimeoutError:
            return HEALTH_STALLED
        except (aiohttp.ClientConnectorError, ConnectionRefusedError):
            return HEALTH_UNREACHABLE
        except (aiohttp.ClientError, OSError):
            return HEALTH_STALLED

    async def post_ok(self, upstream: Upstream, path: str, timeout_s: float = 60.0) -> bool:
        try:
            async with self._session.post(upstream.url + path,
                                          timeout=self._timeout(timeout_s)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def abort(self, upstream: Upstream, rid: str) -> None:
        """Ask a server to drop ``rid``; a server that no longer has it ignores the call."""
        try:
            async with self._session.post(upstream.url + "/abort_request", json={"rid": rid},
                                          timeout=self._timeout(10.0)) as resp:
                await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            logger.warning("abort %s on %s %s failed: %r", rid, upstream.role, upstream.url, err)

    async def cache_only(self, upstream: Upstream, rooms: list[int]) -> Optional[int]:
        """Tell a prefill that ``rooms``' relays answered alone: main's copies of them only warm
        main's cache and go behind every copy a request waits for (POST /pdd/cache_only). The
        prefill's status (202; 404 from a prefill older than the route), None when it could not
        be asked. Best effort: a prefill that misses it keeps the copies needed-now."""
        try:
            async with self._session.post(upstream.url + "/pdd/cache_only",
                                          data=orjson.dumps({"rooms": rooms}), headers=_JSON,
                                          timeout=self._timeout(10.0)) as resp:
                await resp.read()
                if resp.status not in (202, 404):
                    logger.warning("cache-only notice for %d rooms to %s answered %s",
                                   len(rooms), upstream.url, resp.status)
                return resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            logger.warning("cache-only notice for %d rooms to %s failed: %r", len(rooms),
                           upstream.url, err)
            return None

    async def generate_final(self, upstream: Upstream, body: dict) -> dict:
        """A non-streamed /generate (the prefill's side of a request)."""
        try:
            async with self._session.post(upstream.url + "/generate",
                                          data=orjson.dumps({**body, "stream": False}),
                                          headers=_JSON, timeout=self._timeout()) as resp:
                payload = await resp.read()
                if resp.status != 200:
                    raise UpstreamError(upstream, _error_message(payload), "upstream_status",
                                        resp.status)
                return orjson.loads(payload)
        except (aiohttp.ClientError, OSError) as err:
            raise _connection_error(upstream, err) from err
        except asyncio.TimeoutError as err:
            raise UpstreamError(upstream, "timed out", "upstream_timeout") from err

    async def generate_stream(self, upstream: Upstream, body: dict) -> AsyncIterator[UpstreamChunk]:
        """A streamed /generate, each chunk carrying this server's cumulative ids and text."""
        ids: list[int] = []
        text = ""
        resp = None
        try:
            async with self._session.post(upstream.url + "/generate",
                                          data=orjson.dumps({**body, "stream": True}),
                                          headers=_JSON, timeout=self._stream_timeout) as resp:
                if resp.status != 200:
                    raise UpstreamError(upstream, _error_message(await resp.read()),
                                        "upstream_status", resp.status)
                while True:
                    self.silences.heard(resp)
                    # One SSE event per read (SGLang writes "data: {...}\n\n"), not a line.
                    event = await resp.content.readuntil(b"\n\n", max_size=MAX_EVENT_BYTES)
                    if not event:
                        return
                    if not event.startswith(b"data:"):
                        continue
                    data = memoryview(event)[5:]  # orjson reads it as it is, spaces and all
                    if event.startswith(b"data: [DONE]"):
                        # Read to the body's end: a response read whole hands its connection
                        # back to the pool, one left unread closes it (a new connect per request).
                        await resp.content.read()
                        return
                    out = orjson.loads(data)
                    if "error" in out:
                        err = out["error"]
                        raise UpstreamError(upstream, _error_message(err), "upstream_error",
                                            err.get("code") if isinstance(err, dict) else None)
                    meta = out.get("meta_info") or {}
                    reason = meta.get("finish_reason")
                    if isinstance(reason, dict) and reason.get("type") == "abort":
                        # SGLang streams a scheduler-side abort (a KV transfer that failed or
                        # timed out, an overloaded queue) as an ordinary last chunk: for the
                        # router it is a failure of this server, not an answer.
                        raise UpstreamError(upstream, str(reason.get("message") or "aborted"),
                                            "upstream_abort", reason.get("status_code"))
                    if upstream.incremental_streaming_output:
                        # Appended in place, each chunk a view of its prefix (O(new ids) a chunk).
                        ids.extend(out.get("output_ids") or ())
                        text = text + (out.get("text") or "")
                        chunk_ids = IdsPrefix(ids, len(ids))
                    else:
                        chunk_ids = list(out.get("output_ids") or [])
                        text = out.get("text")
                    yield UpstreamChunk(chunk_ids, text, meta,
                                        meta.get("finish_reason") is not None)
        except (aiohttp.ClientError, OSError) as err:
            if resp is not None and self.silences.forget(resp):
                raise UpstreamError(upstream, "no data within the read timeout",
                                    "upstream_timeout") from err
            raise _connection_error(upstream, err) from err
        except asyncio.TimeoutError as err:
            raise UpstreamError(upstream, "no data within the read timeout",
                                "upstream_timeout") from err
        finally:
            if resp is not None:
                self.silences.forget(resp)


def _connection_error(upstream: Upstream, err: BaseException) -> UpstreamError:
    refused = isinstance(err, (aiohttp.ClientConnectorError, ConnectionRefusedError))
    return UpstreamError(upstream, repr(err), "upstream_connection", refused=refused)


def _error_message(payload) -> str:
    if isinstance(payload, (bytes, bytearray)):
        try:
            payload = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return payload.decode(errors="replace")[:500]
    if isinstance(payload, dict):
        inner = payload.get("error", payload)
        if isinstance(inner, dict):
            return str(inner.get("message", inner))
        return str(payload.get("message", inner))
    return str(payload)
