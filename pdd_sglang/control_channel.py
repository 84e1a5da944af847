"""The relay <-> main control channel: PDD messages over ZMQ, authenticated and encrypted with CURVE.

The relay binds a ROUTER socket; each main connects a DEALER to every relay it hands off with. One
connection carries both directions (main: ``HandoffReady``, ``HandoffAck``; relay:
``HandoffTokens``), and the ROUTER's peer identity tells the relay which main spoke.

Across the WAN the channel uses ZMQ's CURVE: each endpoint has a keypair in files made by
``python -m pdd_sglang.control_channel keygen DIR NAME`` (ZMQ's own certificate format), a main
knows its relay's public key, and a relay admits only the mains whose public keys are in its
authorized directory; ZMQ's authenticator refuses every other peer before a byte of PDD payload is
read, and the refusal is logged and counted. Every received frame is decoded by
:func:`pdd_sglang.messages.decode`, which refuses (and we count) malformed, oversized and
unknown-version messages without stopping the channel.
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from pdd_sglang.messages import MessageError, decode, encode

logger = logging.getLogger(__name__)


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

    def close(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
        self.socket.close(linger=0)
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
        if address.endswith(":0"):
            port = self.socket.bind_to_random_port(address.rsplit(":", 1)[0])
            self.address = f"{address.rsplit(':', 1)[0]}:{port}"
        else:
            self.socket.bind(address)
            self.address = address

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
        self.socket.connect(relay_address)

    def receive(self, timeout_ms: int):
        if not self.socket.poll(timeout_ms):
            return None
        return self._decode(self.socket.recv())

    def send(self, message) -> None:
        with self._lock:
            self.socket.send(encode(message))


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
