"""Build a decode server's control loop and handoff settings from its PDD flags."""

from __future__ import annotations

import socket
from collections import Counter, deque
from pathlib import Path
from typing import Any, Optional

from pdd_sglang.protocol.control_channel import ControlLoop, CurveConfig
from pdd_sglang.policy import PolicyConfig


def curve_config(args: Any) -> Optional[CurveConfig]:
    if args.pdd_control_keypair is None:
        return None
    return CurveConfig(
        keypair_file=Path(args.pdd_control_keypair),
        relay_public_key_file=Path(args.pdd_control_relay_key) if args.pdd_control_relay_key else None,
        authorized_mains_dir=(Path(args.pdd_control_authorized_keys)
                              if args.pdd_control_authorized_keys else None),
    )


def advertised_host(bind_host: str, advertise_host: Optional[str] = None) -> str:
    """The address peers dial: --pdd-advertise-host; else the bind host, unless it is a
    wildcard; else SGLang's SGLANG_HOST_IP; else this host's name as it resolves here (which on
    Debian-style hosts is 127.0.1.1: set --pdd-advertise-host when binding 0.0.0.0)."""
    import os

    if advertise_host:
        return advertise_host
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    return os.environ.get("SGLANG_HOST_IP") or socket.gethostbyname(socket.gethostname())


def zmq_address(host: str, port) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def relay_loop(args: Any) -> ControlLoop:
    host = args.host or "127.0.0.1"
    loop = ControlLoop(relay_bind=zmq_address(host, args.pdd_control_port),
                       curve=curve_config(args))
    port = loop.address.rsplit(":", 1)[1]
    loop.address = zmq_address(advertised_host(host, getattr(args, "pdd_advertise_host", None)),
                               port)
    return loop


def main_loop(args: Any) -> ControlLoop:
    return ControlLoop(curve=curve_config(args))


def policy_config(args: Any) -> PolicyConfig:
    return PolicyConfig(catch_up_threshold_tokens=args.pdd_catch_up_threshold,
                        catch_up_chunk_tokens=args.pdd_catch_up_chunk,
                        relay_load_watermark=args.pdd_relay_load_watermark)


# /server_info shows the latest this many latency samples; Prometheus keeps the full histogram.
LATENCY_SAMPLES_KEPT = 256


class HandoffStats:
    """Counts and latencies shown in /server_info (bounded: the latest samples) and, with
    --enable-metrics, in SGLang's /metrics (:mod:`pdd_sglang.diagnostics.metrics`)."""

    def __init__(self, role: str):
        from pdd_sglang.diagnostics.metrics import server_metrics

        self.role = role
        self.events: Counter = Counter()
        self.refused: Counter = Counter()
        self.handed_tokens = 0
        self.payload_bytes = 0
        # main: HandoffReady sent -> first tokens received; and -> last chunk absorbed.
        self.handoff_latency_s: deque = deque(maxlen=LATENCY_SAMPLES_KEPT)
        self.handoff_duration_s: deque = deque(maxlen=LATENCY_SAMPLES_KEPT)
        self._prometheus = server_metrics()  # None without --enable-metrics

    def latency(self, seconds: float) -> None:
        self.handoff_latency_s.append(seconds)
        if self._prometheus:
            self._prometheus.latency.observe(seconds)

    def duration(self, seconds: float) -> None:
        self.handoff_duration_s.append(seconds)
        if self._prometheus:
            self._prometheus.duration.observe(seconds)

    def event(self, name: str, count: int = 1) -> None:
        self.events[name] += count
        if self._prometheus:
            self._prometheus.handoff_event(self.role, name, count)

    def refuse(self, reason: str) -> None:
        self.refused[reason] += 1
        if self._prometheus:
            self._prometheus.handoff_refused(self.role, reason)

    def chunk_sent(self, mode: str, tokens: int, payload_bytes: int) -> None:
        """Relay: one HandoffTokens message sent."""
        self.handed_tokens += tokens
        self.payload_bytes += payload_bytes
        if self._prometheus:
            self._prometheus.handoff_chunk(mode, tokens)

    def snapshot(self, loop: ControlLoop) -> dict:
        refused = Counter(self.refused)
        refused.update(loop.refusals)
        return {
            "role": self.role,
            "control_address": loop.address,
            "events": dict(self.events),
            "refused": dict(refused),
            "handed_tokens": self.handed_tokens,
            "payload_bytes": self.payload_bytes,
            # The latest samples, oldest first.
            "handoff_latency_ms": [round(s * 1e3, 3) for s in self.handoff_latency_s],
            "handoff_duration_ms": [round(s * 1e3, 3) for s in self.handoff_duration_s],
        }
