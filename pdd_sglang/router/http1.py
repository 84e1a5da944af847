"""A lean HTTP/1.1 client for the router's own servers: one asyncio protocol per connection, kept
alive in a pool per server, taken last-released-first.

Why not aiohttp's client: at hundreds of streams the router's tail is rounds of request set-ups,
and aiohttp's client cost about a quarter of a set-up's CPU (two requests per router request:
building a ClientRequest with its default headers, URL and payload objects, a timer context, its
connector's bookkeeping). The SGLang servers speak plain HTTP/1.1: a JSON body answered with a
Content-Length, or a chunked stream of SSE events. So a request here is one write of a prepared
head and body, and the answer is framed by httptools (llhttp) as it arrives, each SSE event
handed to the reader without a copy of the whole body; an answer holding more than
``MAX_BODY_BYTES`` unread is dropped.

What it keeps of aiohttp's behaviour (router/upstream.py relies on it):
- the pool: no size limit; the connection released last is the next one taken, so the ones that
  steady traffic needs stay warm and a burst's extra ones idle out; an idle connection older than
  ``keepalive_s`` is closed, never reused (the servers close theirs at 5 s: a request on a
  connection the server has just closed fails);
- a connection is pooled again only when its answer has arrived whole and the server keeps it
  alive (what its reader left unread of it is dropped: a stream read up to an abort chunk); one
  dropped mid-answer (a cancelled request, a closed stream) is closed;
- a GET on a reused connection that the server had closed is sent once more on a fresh one
  (aiohttp retries idempotent requests once); a POST is never resent;
- errors are OSErrors: ``ConnectError`` when nothing accepted the connection (refused, no
  route), TimeoutError for the connect and read timeouts, ConnectionResetError when the server
  closed the connection mid-answer, ``BadResponse`` for a reply that is not HTTP/1.1 (llhttp's
  reason: conflicting or duplicate lengths, a malformed or truncated chunk, ...) or too large.

Owner: the router's event loop; nothing here is thread-safe.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
import time
from typing import Callable, Optional
from urllib.parse import urlsplit

import httptools

# What an answer may hold unread (its body, or a stream's events not yet handed over) before
# the connection is dropped as a BadResponse: a cumulative stream's last event holds the whole
# answer (upstream.MAX_EVENT_BYTES), a busy prefill's /server_info about 1 MB.
MAX_BODY_BYTES = 64 << 20


class ConnectError(OSError):
    """No connection: the server refused it or could not be reached (not a timeout)."""


class BadResponse(OSError):
    """The server's reply is not HTTP/1.1 this client can read."""


class HttpStatusError(Exception):
    """A status of 400 or more where the caller asked for success (``raise_for_status``)."""

    def __init__(self, status: int, url: str):
        super().__init__(f"{status} from {url}")
        self.status = status


class Target:
    """Where one server's requests go, parsed once per URL."""

    __slots__ = ("key", "host", "port", "ssl", "prefix", "host_header")

    def __init__(self, url: str):
        parts = urlsplit(url)
        self.ssl = parts.scheme == "https"
        self.host = parts.hostname or "localhost"
        self.port = parts.port or (443 if self.ssl else 80)
        self.prefix = parts.path.rstrip("/")
        self.key = (self.host, self.port, self.ssl)
        self.host_header = parts.netloc.rpartition("@")[2].encode("latin-1")


class Connection(asyncio.Protocol):
    """One connection to a server and the answer being read on it (one at a time).

    The answer is framed by httptools (llhttp, the parser uvicorn runs): status line, headers,
    Content-Length or chunked bodies, and what HTTP/1.1 refuses (a Content-Length beside a
    Transfer-Encoding, duplicate lengths, a malformed or truncated chunk), each a BadResponse
    naming llhttp's reason. One parser per answer: bytes past the answer's end are refused."""

    def __init__(self, pool: "Pool", key: tuple):
        self.pool, self.key = pool, key
        self.transport: Optional[asyncio.Transport] = None
        self.reused = False
        self.idle_since = 0.0
        self.error: Optional[BaseException] = None
        self.received = 0  # reads with data, for the silence watch (upstream.SilenceWatch)
        self._waiter: Optional[asyncio.Future] = None
        self._body = bytearray()  # the answer's body, de-chunked, not read yet
        self._scanned = 0  # how far _body holds no event separator
        # The reader of a stream's events (read_events): each complete event as it arrives,
        # True once the reader wants no more.
        self._on_event: Optional[Callable[[bytes], bool]] = None
        self._max_event = 0
        self.keep_alive = True
        self._reset()

    # -- the protocol: called by the event loop -------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received += 1
        try:
            self._parser.feed_data(data)
            if self._past_end:
                raise BadResponse("data after the end of the answer")
            if len(self._body) > self.pool.max_body_bytes:
                raise BadResponse(f"answer body over {self.pool.max_body_bytes} bytes unread")
            if self._on_event is not None and not self._deliver_events():
                return  # the events went to the reader's callback: no wake of the reader
        except (ValueError, BadResponse, httptools.HttpParserError) as err:
            self._fail(err if isinstance(err, BadResponse) else BadResponse(str(err)))
            self.transport.close()
            return
        self._wake()

    def eof_received(self) -> None:
        if self._head_done and not self._framed:
            self.body_done = True  # a body delimited by the connection's end
        self.keep_alive = False

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self.keep_alive = False
        if not self.body_done:
            self._fail(exc if isinstance(exc, OSError) else
                       ConnectionResetError("server disconnected"))
        self.pool.forget(self)
        self._wake()

    # -- the answer, as httptools parses it (its callbacks) -------------------------------
    def on_message_begin(self) -> None:
        self._past_end = self.body_done  # a second answer: nothing was asked for it

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()
        self._head_done = True

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.body_done = True

    def _fail(self, err: BaseException) -> None:
        if self.error is None:
            self.error = err

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self, read_timeout_s: Optional[float]) -> None:
        """Until more of the answer arrives (or the connection fails)."""
        if self.error is not None:
            raise self.error
        loop = self.pool.loop
        waiter = self._waiter = loop.create_future()
        timer = None
        if read_timeout_s is not None:
            timer = loop.call_later(read_timeout_s, _time_out, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
        if self.error is not None:
            raise self.error

    async def head(self, read_timeout_s: Optional[float]) -> int:
        """The answer's status, once its head has arrived."""
        while not self._head_done:
            await self._wait(read_timeout_s)
        return self.status

    async def read(self, read_timeout_s: Optional[float]) -> bytes:
        """The whole body."""
        await self.head(read_timeout_s)
        while not self.body_done:
            await self._wait(read_timeout_s)
        body = bytes(self._body)
        self._body.clear()
        return body

    async def read_events(self, on_event: Callable[[bytes], bool], max_size: int) -> None:
        """Hand each SSE event (its ``\\n\\n`` included; at the body's end what is left) to
        ``on_event`` as it arrives, until ``on_event`` returns True or the body ends.

        The events are handed over from the event loop's read callback: a stream of hundreds
        of tokens a second costs no wake-up of its reader per event, only at its end (or its
        failure, raised here). ``on_event`` must not raise. No read timeout: a stream's silence
        is watched elsewhere (upstream.SilenceWatch)."""
        self._on_event, self._max_event = on_event, max_size
        try:
            # Woken only once the read callback is done with the events (it clears
            # _on_event), or when the body ends without it (a body the connection's end ends).
            while self._on_event is not None and not self._deliver_events():
                await self._wait(None)
        finally:
            self._on_event = None

    def _deliver_events(self) -> bool:
        """The complete events received, to the reader's callback; True when the reader is done
        with them (its callback said so, or the body ended)."""
        body, on_event = self._body, self._on_event
        start, end = 0, body.find(b"\n\n", self._scanned)
        try:
            while end >= 0:
                event = bytes(body[start:end + 2])
                start = end + 2
                if on_event(event):
                    self._on_event = None
                    return True
                end = body.find(b"\n\n", start)
        finally:
            del body[:start]
            self._scanned = max(len(body) - 1, 0)
        if len(body) > self._max_event:
            raise ValueError("Chunk too big")  # as aiohttp's StreamReader.readuntil
        if self.body_done:
            if body:
                on_event(bytes(body))
                body.clear()
            self._on_event = None
            return True
        return False

    def close(self) -> None:
        """Drop the connection: its reader fails with ConnectionResetError."""
        self.keep_alive = False
        self._fail(ConnectionResetError("connection closed by the router"))
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _reset(self) -> None:
        """Ready for the next request on this connection: a parser for its answer."""
        self._parser = httptools.HttpResponseParser(self)
        self.status, self._head_done, self.body_done = 0, False, False
        self._framed, self._past_end, self._scanned = False, False, 0
        self._body.clear()


def _time_out(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("no data within the read timeout"))


class Pool:
    """Keep-alive connections by server, taken last-released-first, none kept idle longer than
    ``keepalive_s``; no limit on how many (each in-flight request holds one per server)."""

    def __init__(self, connect_timeout_s: float, keepalive_s: float,
                 authorization: Optional[bytes] = None,
                 ssl_context: Optional[ssl_module.SSLContext] = None):
        # Every request's Authorization header (the servers' --api-key), unless send() names one.
        self.authorization = authorization
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self.loop = asyncio.get_running_loop()
        self._idle: dict[tuple, list[Connection]] = {}
        self._open_conns: set[Connection] = set()  # idle or in use: close() ends them all
        self._targets: dict[str, Target] = {}
        # For https:// servers (the system's CAs unless given one).
        self._ssl: Optional[ssl_module.SSLContext] = ssl_context
        self.max_body_bytes = MAX_BODY_BYTES
        self.opened = 0  # connections opened, for tests and probes

    def target(self, url: str) -> Target:
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = Target(url)
        return target

    async def send(self, url: str, method: bytes, path: str, body: bytes = b"",
                   content_type: Optional[bytes] = None, fresh: bool = False,
                   authorization: Optional[bytes] = None) -> Connection:
        """The request written on a pooled connection (a new one when none is idle, or when
        ``fresh``); read its answer from the connection, then hand it to ``release``."""
        target = self.target(url)
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (
            method, (target.prefix + path).encode("latin-1"), target.host_header)
        authorization = authorization or self.authorization
        if authorization is not None:
            head += b"Authorization: %s\r\n" % authorization
        if content_type is not None:
            head += b"Content-Type: %s\r\n" % content_type
        if body or method == b"POST":
            head += b"Content-Length: %d\r\n\r\n" % len(body)
        else:
            head += b"\r\n"
        conn = None if fresh else self._take(target.key)
        if conn is None:
            conn = await self._open(target)
        conn.transport.write(head + body)  # one write, one copy of the body: one send
        return conn

    def _take(self, key: tuple) -> Optional[Connection]:
        idle = self._idle.get(key)
        if not idle:
            return None
        oldest = time.monotonic() - self.keepalive_s
        while idle:
            conn = idle.pop()
            if conn.idle_since < oldest:
                # Released last and already too old: every other idle one is older still.
                for stale in (conn, *idle):
                    stale.transport.close()
                idle.clear()
                return None
            if conn.keep_alive and not conn.transport.is_closing():
                conn._reset()
                conn.reused = True
                return conn
            conn.transport.close()
        return None

    async def _open(self, target: Target) -> Connection:
        ssl = None
        if target.ssl:
            if self._ssl is None:
                self._ssl = ssl_module.create_default_context()
            ssl = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await self.loop.create_connection(
                    lambda: Connection(self, target.key), target.host, target.port, ssl=ssl)
        except TimeoutError as err:
            raise TimeoutError(f"connect to {target.host}:{target.port} timed out") from err
        except OSError as err:
            message = f"cannot connect to {target.host}:{target.port}: {err.strerror or err}"
            raise (ConnectError(message) if err.errno is None else
                   ConnectError(err.errno, message)) from err
        self.opened += 1
        self._open_conns.add(conn)
        return conn

    def release(self, conn: Connection) -> None:
        """Back to the pool when its answer has arrived whole and it stays open; else closed.
        A reader may stop before the end of an answer that has all arrived (main's abort chunk
        when its relay answered alone, then ``[DONE]``): the server is done with it, and a new
        connection per such request would cost a connect on both sides."""
        if conn.body_done and conn.keep_alive and conn.error is None \
                and not conn.transport.is_closing():
            conn.idle_since = time.monotonic()
            idle = self._idle.get(conn.key)
            if idle is None:
                idle = self._idle[conn.key] = []
            idle.append(conn)
        else:
            conn.keep_alive = False
            conn.transport.close()

    def forget(self, conn: Connection) -> None:
        """A closed connection leaves the pool."""
        self._open_conns.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def close(self) -> None:
        """Every connection closed, idle or in use (a reader of one fails)."""
        for conn in list(self._open_conns):
            conn.close()
        self._open_conns.clear()
        self._idle.clear()
