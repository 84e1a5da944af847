"""The relay <-> main control channel: PDD messages over ZMQ, authenticated and encrypted with CURVE.

The relay binds a ROUTER socket; each main connects a DEALER to every relay it hands off with. One
connection carries both directions (main: ``HandoffReady``, ``HandoffAck``; relay:
``HandoffTokens``), and the ROUTER's peer identity tells the relay which main spoke.

Across the WAN the channel uses ZMQ's CURVE: each endpoint has a keypair in files made by
``python -m pdd_sglang.protocol.control_channel keygen DIR NAME`` (ZMQ's own certificate format), a main
knows its relay's public key, and a relay admits only the mains whose public keys are in its
authorized directory; ZMQ's authenticator refuses every other peer before a byte of PDD payload is
read, and the refusal is logged and counted. Every received frame is decoded by
:func:`pdd_sglang.protocol.messages.decode`, which refuses (and we count) malformed, oversized and
unknown-version messages without stopping the channel.
"""

from __future__ import annotations

import argparse
import logging
import queue
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from pdd_sglang.protocol.messages import MessageError, decode, encode

logger = logging.getLogger(__name__)

# A main notices a dead relay from ZMQ itself: the TCP connection drops (process gone), or ZMQ's
# heartbeats go unanswered this long (line cut, host hung).
HEARTBEAT_INTERVAL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
# close(): how long the I/O thread may take to flush what the scheduler queued last (refusals
# that let the peer finish a request) and to stop; sockets then close with a bounded linger.
CLOSE_JOIN_TIMEOUT_S = 5.0
CLOSE_LINGER_MS = 1000


class ControlChannelError(RuntimeError):
    """The control channel could not start (the port is taken, the address is wrong)."""


@dataclass(frozen=True)
class PeerState:
    """Not a wire message: the loop's note that the connection to ``address`` came up or went
    down."""

    address: str
    connected: bool


@dataclass(frozen=True)
class CurveConfig:
    """Key files of one endpoint. ``None`` everywhere means a plain channel (same host only)."""

    keypair_file: Path  # this endpoint's ``.key_secret`` file
    relay_public_key_file: Optional[Path] = None  # on a main: the relay's ``.key`` file
    authorized_mains_dir: Optional[Path] = None  # on a relay: the mains' ``.key`` files


class _CountingAuthenticator(ThreadAuthenticator):
    """ZMQ's ZAP authenticator, logging and counting the peers it turns away."""

    def __init__(self, context: zmq.Context, refusals: Counter):
        super().__init__(context)
        self._refusals = refusals

    # pyzmq's one exit for every ZAP verdict (zmq.auth.base.Authenticator).
    def _send_zap_reply(self, request_id, status_code, status_text, user_id="anonymous"):
        if status_code != b"200":
            self._refusals["unauthorized_peer"] += 1
            logger.warning("PDD control channel refused a peer: %s", status_text)
        return super()._send_zap_reply(request_id, status_code, status_text, user_id)


class _Endpoint:
    def __init__(self, socket_type: int):
        self.context = zmq.Context()
        self.socket = self.context.socket(socket_type)
        self.socket.setsockopt(zmq.LINGER, 0)
        # A bound on what ZMQ itself buffers from one frame, before our own size check.
        self.socket.setsockopt(zmq.MAXMSGSIZE, 4 << 20)
        self.refusals: Counter = Counter()
        self._lock = threading.Lock()
        self._authenticator: Optional[ThreadAuthenticator] = None

    def _decode(self, data: bytes):
        try:
            return decode(data)
        except MessageError as err:
            self.refusals[err.reason] += 1
            logger.warning("PDD control channel refused a message: %s", err)
            return None

    def close(self, linger_ms: int = 0) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()  # joins ZMQ's authenticator thread
            self._authenticator = None
        self.socket.close(linger=linger_ms)
        self.context.term()


class RelayControlServer(_Endpoint):
    """The relay's end: binds, and talks to whichever mains connect."""

    def __init__(self, address: str, curve: Optional[CurveConfig] = None):
        super().__init__(zmq.ROUTER)
        if curve is not None:
            if curve.authorized_mains_dir is None:
                raise ValueError("a CURVE relay needs authorized_mains_dir (the mains' public keys)")
            self._authenticator = _CountingAuthenticator(self.context, self.refusals)
            self._authenticator.start()
            self._authenticator.configure_curve(domain="*", location=str(curve.authorized_mains_dir))
            public, secret = zmq.auth.load_certificate(str(curve.keypair_file))
            self.socket.curve_publickey = public
            self.socket.curve_secretkey = secret
            self.socket.curve_server = True
        try:
            if address.endswith(":0"):
                port = self.socket.bind_to_random_port(address.rsplit(":", 1)[0])
                self.address = f"{address.rsplit(':', 1)[0]}:{port}"
            else:
                self.socket.bind(address)
                self.address = address
        except zmq.ZMQError as err:
            self.close()
            if err.errno == zmq.EADDRINUSE:
                raise ControlChannelError(
                    f"PDD relay: control address {address} is already in use (another relay on "
                    f"this host with the same --pdd-control-port?); give each relay its own "
                    f"port, or 0 for a free one") from None
            raise ControlChannelError(f"PDD relay: cannot bind the control channel at "
                                      f"{address}: {err}") from None

    def receive(self, timeout_ms: int):
        """``(peer, message)``, or ``None`` on timeout or a refused message."""
        if not self.socket.poll(timeout_ms):
            return None
        frames = self.socket.recv_multipart()
        if len(frames) != 2:
            self.refusals["malformed"] += 1
            return None
        message = self._decode(frames[1])
        return None if message is None else (frames[0], message)

    def send(self, peer: bytes, message) -> None:
        with self._lock:
            self.socket.send_multipart([peer, encode(message)])


class MainControlClient(_Endpoint):
    """A main's end, connected to one relay."""

    def __init__(self, relay_address: str, curve: Optional[CurveConfig] = None):
        super().__init__(zmq.DEALER)
        if curve is not None:
            if curve.relay_public_key_file is None:
                raise ValueError("a CURVE main needs relay_public_key_file")
            public, secret = zmq.auth.load_certificate(str(curve.keypair_file))
            relay_public, _ = zmq.auth.load_certificate(str(curve.relay_public_key_file))
            self.socket.curve_publickey = public
            self.socket.curve_secretkey = secret
            self.socket.curve_serverkey = relay_public
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_INTERVAL_MS)
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.socket.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
        self.monitor = self.socket.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.connected = False
        self.socket.connect(relay_address)

    def connection_events(self) -> list[bool]:
        """Connection changes since the last call: True connected, False lost."""
        changes = []
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            self.connected = event == zmq.EVENT_CONNECTED
            changes.append(self.connected)
        return changes

    def close(self, linger_ms: int = 0) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        super().close(linger_ms)

    def receive(self, timeout_ms: int):
        if not self.socket.poll(timeout_ms):
            return None
        return self._decode(self.socket.recv())

    def send(self, message) -> None:
        with self._lock:
            self.socket.send(encode(message))


class ControlLoop:
    """One I/O thread that owns a server's control sockets; the scheduler never touches them.

    ZMQ sockets must stay on one thread, and the scheduler must not block on the network. The
    scheduler calls :meth:`send` (queued, then a one-byte wake-up over an ``inproc`` pair) and
    drains :meth:`received` once per step. On a relay the loop binds one
    :class:`RelayControlServer` and a peer is a ROUTER identity; on a main it connects one
    :class:`MainControlClient` per relay address on first use, and a peer is that address;
    when a relay's connection comes up or goes down, :meth:`received` yields
    ``(address, PeerState(address, connected))``.

    :meth:`close` (idempotent) flushes what was queued, closes every socket (the authenticator's
    thread joined) and joins the I/O thread with a timeout. If the I/O thread dies, :meth:`send`
    logs it once and drops messages: the handoff sides see :attr:`alive` go False and serve
    without handoffs, and the scheduler thread never blocks or raises on the dead channel.
    """

    def __init__(self, relay_bind: Optional[str] = None, curve: Optional[CurveConfig] = None):
        self._curve = curve
        self._server = RelayControlServer(relay_bind, curve) if relay_bind is not None else None
        self.address = self._server.address if self._server is not None else None
        self._clients: dict[str, MainControlClient] = {}
        self._inbox: "queue.Queue[tuple]" = queue.Queue()
        self._outbox: "queue.Queue[tuple]" = queue.Queue()
        self._wake_context = zmq.Context()
        wake_address = f"inproc://pdd-control-wake-{id(self)}"
        self._wake_pull = self._wake_context.socket(zmq.PULL)
        self._wake_pull.bind(wake_address)
        self._wake_push = self._wake_context.socket(zmq.PUSH)
        self._wake_push.connect(wake_address)
        self._wake_lock = threading.Lock()
        self._stopping = False
        self._closed = False
        self._dead_logged = False
        self._thread = threading.Thread(target=self._run, name="pdd-control", daemon=True)
        self._thread.start()

    # ---- scheduler side ---------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """False once the I/O thread has stopped (closed, or died on an error)."""
        return self._thread.is_alive()

    def send(self, peer, message) -> None:
        if not self.alive:
            if not self._dead_logged and not self._closed:
                self._dead_logged = True
                logger.error("PDD control loop is not running; handoff messages are dropped "
                             "and requests are served without handoffs")
            return
        self._outbox.put((peer, message))
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_push.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # ZMQ's queue of wake-ups is full: the I/O thread has one to read already

    def received(self) -> list[tuple]:
        """Every ``(peer, message)`` that arrived since the last call (never blocks)."""
        items = []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    def wait_received(self, timeout_s: float):
        """One ``(peer, message)``, or ``None`` after ``timeout_s`` (tests and tools)."""
        try:
            return self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    @property
    def refusals(self) -> Counter:
        total: Counter = Counter()
        for endpoint in self._endpoints():
            total.update(endpoint.refusals)
        return total

    def close(self) -> None:
        """Flush what is queued, stop the I/O thread (joined with a timeout), close the sockets.
        Safe to call twice, and after the I/O thread died."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        self._wake()
        self._thread.join(timeout=CLOSE_JOIN_TIMEOUT_S)
        if self._thread.is_alive():  # stuck in a socket call: leave its sockets to the process
            logger.error("PDD control loop did not stop within %.0f s", CLOSE_JOIN_TIMEOUT_S)
            return
        self._wake_push.close(linger=0)
        self._wake_pull.close(linger=0)
        self._wake_context.term()

    # ---- I/O thread ---------------------------------------------------------------------------
    def _endpoints(self) -> list:
        return ([self._server] if self._server is not None else []) + list(self._clients.values())

    def _client(self, address: str) -> MainControlClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = MainControlClient(address, self._curve)
        return client

    def _run(self) -> None:
        try:
            while not self._stopping:
                poller = zmq.Poller()
                poller.register(self._wake_pull, zmq.POLLIN)
                sockets = {}
                monitors = {}
                for peer, endpoint in ([(None, self._server)] if self._server else []) + list(
                        self._clients.items()):
                    poller.register(endpoint.socket, zmq.POLLIN)
                    sockets[endpoint.socket] = (peer, endpoint)
                    if peer is not None:
                        poller.register(endpoint.monitor, zmq.POLLIN)
                        monitors[endpoint.monitor] = (peer, endpoint)
                for socket, _ in poller.poll(1000):
                    if socket is self._wake_pull:
                        while self._wake_pull.poll(0):
                            self._wake_pull.recv()
                        self._flush_outbox()
                        continue
                    if socket in monitors:
                        peer, endpoint = monitors[socket]
                        for connected in endpoint.connection_events():
                            if not connected:
                                logger.warning("PDD control channel: lost relay %s", peer)
                            self._inbox.put((peer, PeerState(peer, connected)))
                        continue
                    peer, endpoint = sockets[socket]
                    item = endpoint.receive(0)
                    if item is None:
                        continue
                    self._inbox.put(item if peer is None else (peer, item))
            self._flush_outbox()  # the last words queued before close() (refusals)
        except Exception:  # the channel dies loudly, never silently
            logger.exception("PDD control loop stopped")
        finally:
            linger = CLOSE_LINGER_MS if self._stopping else 0
            for endpoint in self._endpoints():
                try:
                    endpoint.close(linger)
                except Exception:  # one bad endpoint must not keep the others open
                    logger.exception("PDD control channel: closing an endpoint failed")

    def _flush_outbox(self) -> None:
        while True:
            try:
                peer, message = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                if self._server is not None:
                    self._server.send(peer, message)
                else:
                    self._client(peer).send(message)
            except zmq.ZMQError as err:
                logger.warning("PDD control channel could not send to %r: %s", peer, err)


def keygen(directory: Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public, to share) and ``NAME.key_secret`` (keep) into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="PDD control-channel keys (ZMQ CURVE).")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("keygen", help="make a keypair: DIR/NAME.key and DIR/NAME.key_secret")
    gen.add_argument("directory", type=Path)
    gen.add_argument("name")
    args = parser.parse_args(argv)
    public, secret = keygen(args.directory, args.name)
    print(f"public key: {public}\nsecret key: {secret} (mode 600; keep it on this host)")


if __name__ == "__main__":
    main()
