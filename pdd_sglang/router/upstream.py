"""HTTP to the SGLang servers: streamed /generate normalised to cumulative chunks, abort, health."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from typing import Callable, Optional

import orjson

from pdd_sglang.router.http1 import BadResponse, ConnectError, HttpStatusError, Pool
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
# Bodies are encoded with orjson: the standard library's encoder takes about half a millisecond
# for a 2K-token prompt's input_ids, three times a request (router bench).
_JSON = b"application/json"


class SilenceWatch:
    """The read timeout of every streamed answer, kept by one timer: a stream silent for
    ``timeout_s`` is closed, and its reader fails with "no data within the read timeout".
    A read timeout per stream would re-arm a timer at every chunk received (aiohttp's did), a
    timer per token relayed at hundreds of streams; a clock read per chunk is spared too: the
    connection counts the reads it gets (router/http1.py, ``received``), and the timer notes when
    that count last moved (a silence is thus seen within ``timeout_s`` + 2 periods). Keyed by
    the stream's connection. Owner: the router's event loop."""

    PERIOD_S = 1.0

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._heard: dict = {}  # connection -> (its reads, loop time they were last seen to grow)
        self._expired: set = set()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def watch(self, conn) -> None:
        """``conn``'s stream is silent from now until it receives something."""
        self._heard[conn] = (conn.received, self._loop.time())

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
            now, heard, silent = self._loop.time(), self._heard, []
            for conn, (reads, since) in heard.items():
                if conn.received != reads:
                    heard[conn] = (conn.received, now)
                elif now - since > self.timeout_s:
                    silent.append(conn)
            for response in silent:
                del self._heard[response]
                self._expired.add(response)
                response.close()


class UpstreamClient:
    """The router's requests to its servers, over router/http1.py's pool: keep-alive
    connections taken last-released-first, dropped after ``keepalive_s`` idle."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, keepalive_s: float,
                 keys: tuple[Optional[bytes], Optional[bytes]] = (None, None),
                 tls: Optional[ssl.SSLContext] = None):
        # The Authorization header's value on every call, and on administrative ones
        # (router/front_door.upstream_keys); None: no header.
        self.key, self.admin_key = keys
        self.tls = tls  # for https:// servers (router/front_door.upstream_tls)
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_s = keepalive_s
        self._pool: Optional[Pool] = None
        self.silences = SilenceWatch(read_timeout_s)

    async def start(self) -> None:
        # No pool limit: each in-flight request holds one stream per server. Idle pooled
        # connections are dropped before the servers' own keep-alive (SGLang's uvicorn: 5 s,
        # SGLANG_TIMEOUT_KEEP_ALIVE) closes them: reusing one the server has just closed fails
        # the request with "server disconnected" (seen across the emulated WAN, where the race
        # window is an RTT wide). Kept as long as that allows (--upstream-keepalive-s): a burst
        # of requests that finds the pool emptied opens a connection per request and server.
        self._pool = Pool(self.connect_timeout_s, self.keepalive_s, self.key, self.tls)
        self.silences.start()

    async def close(self) -> None:
        self.silences.stop()
        if self._pool is not None:
            self._pool.close()

    async def _exchange(self, upstream: Upstream, method: bytes, path: str, body: bytes = b"",
                        timeout_s: Optional[float] = None,
                        authorization: Optional[bytes] = None) -> tuple[int, bytes]:
        """One request answered whole: (status, body). ``timeout_s`` bounds all of it, and the
        answer fails after ``read_timeout_s`` without data (aiohttp's total and sock_read)."""
        if timeout_s is None:
            return await self._answered(upstream, method, path, body, authorization)
        async with asyncio.timeout(timeout_s):
            return await self._answered(upstream, method, path, body, authorization)

    async def _answered(self, upstream: Upstream, method: bytes, path: str,
                        body: bytes, authorization: Optional[bytes]) -> tuple[int, bytes]:
        # A GET whose reused connection the server had closed goes once more on a new one, as
        # aiohttp retries an idempotent request; a POST may have reached the server: never.
        for fresh in (False, True):
            conn = await self._pool.send(upstream.url, method, path, body,
                                         _JSON if body else None, fresh, authorization)
            try:
                payload = await conn.read(self.read_timeout_s)
                return conn.status, payload
            except (ConnectionResetError, BadResponse):
                if fresh or not conn.reused or method != b"GET" or conn.status:
                    raise
            finally:
                self._pool.release(conn)
        raise AssertionError("unreachable")

    async def get_json(self, upstream: Upstream, path: str, timeout_s: float = 30.0) -> dict:
        payload = await self.get_bytes(upstream, path, timeout_s) or b"null"
        try:
            # A busy prefill's /server_info holds its whole transfer ledger (about 1 MB for
            # 8,192 rows), parsed on the event loop at every health poll: 12 ms with the
            # standard library's parser, half that with orjson.
            return orjson.loads(payload)
        except orjson.JSONDecodeError:  # NaN or Infinity, which only the standard one reads
            return json.loads(payload)

    async def get_bytes(self, upstream: Upstream, path: str, timeout_s: float = 30.0) -> bytes:
        """The raw body, for readers that parse only what they need (router/line_state.py);
        HttpStatusError (its ``status``) for an answer of 400 or more."""
        status, payload = await self._exchange(upstream, b"GET", path, timeout_s=timeout_s)
        if status >= 400:
            raise HttpStatusError(status, upstream.url + path)
        return payload

    async def healthy(self, upstream: Upstream, timeout_s: float = 10.0) -> bool:
        return await self.health(upstream, timeout_s) == HEALTH_OK

    async def health(self, upstream: Upstream, timeout_s: float = 10.0) -> str:
        """HEALTH_OK; HEALTH_STALLED when the server is there but did not say healthy (SGLang's
        /health answers 503 while its scheduler is busy past its own deadline), did not answer in
        time, or dropped the connection mid-answer (a pooled connection the server had just
        closed fails that way too); HEALTH_UNREACHABLE when nothing accepts the connection (the
        process is gone), which takes the server out of rotation at once."""
        try:
            status, _ = await self._exchange(upstream, b"GET", "/health", timeout_s=timeout_s)
            return HEALTH_OK if status == 200 else HEALTH_STALLED
        except TimeoutError:  # an OSError: before it
            return HEALTH_STALLED
        except ConnectError:
            return HEALTH_UNREACHABLE
        except OSError:
            return HEALTH_STALLED

    async def post_json(self, upstream: Upstream, path: str, body: bytes) -> tuple[int, bytes]:
        """POST a JSON body, answered whole: (status, body); bounded by ``read_timeout_s``
        without data, as every answer is."""
        return await self._exchange(upstream, b"POST", path, body)

    async def post_ok(self, upstream: Upstream, path: str, timeout_s: float = 60.0,
                      admin: bool = False) -> bool:
        """Whether the server answered 200; ``admin``: an administrative route, sent with the
        servers' admin key."""
        try:
            status, _ = await self._exchange(upstream, b"POST", path, timeout_s=timeout_s,
                                             authorization=self.admin_key if admin else None)
            return status == 200
        except OSError:  # timeouts included
            return False

    async def abort(self, upstream: Upstream, rid: str) -> None:
        """Ask a server to drop ``rid``; a server that no longer has it ignores the call."""
        try:
            await self._exchange(upstream, b"POST", "/abort_request",
                                 orjson.dumps({"rid": rid}), timeout_s=10.0)
        except OSError as err:
            logger.warning("abort %s on %s %s failed: %r", rid, upstream.role, upstream.url, err)

    async def relay_notice(self, upstream: Upstream, kind: str,
                           rooms: list[int]) -> Optional[int]:
        """Tell a prefill about ``rooms``' relays (POST /pdd/<kind>): ``cache_only``, they
        answered alone, so main's copies only warm main's cache and go behind every copy a
        request waits for; ``relay_lost``, they died while they answered, so main's copies go on
        with the window that fills the line. The prefill's status (202; 404 from a prefill older
        than the route), None when it could not be asked. Best effort: a prefill that misses a
        notice keeps the copies as they were."""
        try:
            status, _ = await self._exchange(upstream, b"POST", f"/pdd/{kind}",
                                             orjson.dumps({"rooms": rooms}), timeout_s=10.0)
        except OSError as err:
            logger.warning("%s notice for %d rooms to %s failed: %r", kind, len(rooms),
                           upstream.url, err)
            return None
        if status not in (202, 404):
            logger.warning("%s notice for %d rooms to %s answered %s", kind, len(rooms),
                           upstream.url, status)
        return status

    async def generate_final(self, upstream: Upstream, body: dict) -> dict:
        """A non-streamed /generate (the prefill's side of a request). Its timeouts (connect,
        no data for ``read_timeout_s``) fail it as a connection failure, as aiohttp's did."""
        try:
            status, payload = await self._exchange(upstream, b"POST", "/generate",
                                                   orjson.dumps({**body, "stream": False}))
        except OSError as err:
            raise _connection_error(upstream, err) from err
        if status != 200:
            raise UpstreamError(upstream, _error_message(payload), "upstream_status", status)
        return orjson.loads(payload)

    async def stream_into(self, upstream: Upstream, body: dict,
                          deliver: Callable[[UpstreamChunk], None]) -> None:
        """A streamed /generate: ``deliver`` gets each chunk, normalised to this server's
        cumulative ids and text, as it arrives (called from the event loop's read callback, so
        it must not block or raise); returns at the stream's end, raises what failed it."""
        events = _StreamEvents(upstream, deliver)
        conn = None
        try:
            conn = await self._pool.send(upstream.url, b"POST", "/generate",
                                         orjson.dumps({**body, "stream": True}), _JSON)
            # No read timeout of its own: the silence watch keeps it, once the head is in.
            status = await conn.head(None)
            if status != 200:
                raise UpstreamError(upstream, _error_message(await conn.read(None)),
                                    "upstream_status", status)
            self.silences.watch(conn)
            await conn.read_events(events.event, MAX_EVENT_BYTES)
            if events.failure is not None:
                raise events.failure
            if events.done:
                # Read to the body's end: an answer read whole hands its connection back to
                # the pool, one left unread closes it (a new connect per request).
                await conn.read(None)
        except OSError as err:
            if conn is not None and self.silences.forget(conn):
                raise UpstreamError(upstream, "no data within the read timeout",
                                    "upstream_timeout") from err
            raise _connection_error(upstream, err) from err
        finally:
            if conn is not None:
                self.silences.forget(conn)
                self._pool.release(conn)


class _StreamEvents:
    """One stream's SSE events (SGLang writes one ``data: {...}\\n\\n`` per chunk) turned
    into chunks for the reader's ``deliver``; what ends the stream: ``[DONE]`` (``done``), or a
    chunk that fails it (``failure``: an error, a scheduler-side abort)."""

    __slots__ = ("upstream", "deliver", "failure", "done", "_ids", "_text")

    def __init__(self, upstream: Upstream, deliver: Callable[[UpstreamChunk], None]):
        self.upstream, self.deliver = upstream, deliver
        self.failure: Optional[BaseException] = None
        self.done = False
        self._ids: list[int] = []
        self._text = ""

    def event(self, event: bytes) -> bool:
        """One event; True once the stream has ended."""
        if not event.startswith(b"data:"):
            return False
        if event.startswith(b"data: [DONE]"):
            self.done = True
            return True
        try:
            self.deliver(self._chunk(orjson.loads(memoryview(event)[5:])))  # spaces and all
        except Exception as err:  # noqa: BLE001 - the reader raises it, as a read would
            self.failure = err
            return True
        return False

    def _chunk(self, out: dict) -> UpstreamChunk:
        upstream = self.upstream
        if "error" in out:
            err = out["error"]
            raise UpstreamError(upstream, _error_message(err), "upstream_error",
                                err.get("code") if isinstance(err, dict) else None)
        meta = out.get("meta_info") or {}
        reason = meta.get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            # SGLang streams a scheduler-side abort (a KV transfer that failed or timed out,
            # an overloaded queue) as an ordinary last chunk: for the router it is a failure of
            # this server, not an answer.
            raise UpstreamError(upstream, str(reason.get("message") or "aborted"),
                                "upstream_abort", reason.get("status_code"))
        if upstream.incremental_streaming_output:
            # Appended in place, each chunk a view of its prefix (O(new ids) a chunk).
            ids = self._ids
            ids.extend(out.get("output_ids") or ())
            self._text = text = self._text + (out.get("text") or "")
            chunk_ids = IdsPrefix(ids, len(ids))
        else:
            chunk_ids = list(out.get("output_ids") or [])
            text = out.get("text")
        return UpstreamChunk(chunk_ids, text, meta, reason is not None)


def _connection_error(upstream: Upstream, err: BaseException) -> UpstreamError:
    refused = isinstance(err, ConnectError)
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
