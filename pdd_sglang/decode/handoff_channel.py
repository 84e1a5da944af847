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


def advertised_host(bind_host: str) -> str:
    """The address peers should dial: the bind host, unless it is a wildcard."""
    import os

    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    return os.environ.get("SGLANG_HOST_IP") or socket.gethostbyname(socket.gethostname())


def relay_loop(args: Any) -> ControlLoop:
    host = args.host or "127.0.0.1"
    loop = ControlLoop(relay_bind=f"tcp://{host}:{args.pdd_control_port}", curve=curve_config(args))
    port = loop.address.rsplit(":", 1)[1]
    loop.address = f"tcp://{advertised_host(host)}:{port}"
    return loop


def main_loop(args: Any) -> ControlLoop:
    return ControlLoop(curve=curve_config(args))


def policy_config(args: Any) -> PolicyConfig:
    return PolicyConfig(catch_up_threshold_tokens=args.pdd_catch_up_threshold,
                        catch_up_chunk_tokens=args.pdd_catch_up_chunk,
                        relay_load_watermark=args.pdd_relay_load_watermark)


# /server_info shows the latest this many latency samples; Prometheus keeps the full histogram.
LATENCY_SAMPLES_KEPT = 256
# Seconds: a same-host handoff takes milliseconds, a Catch-Up over a slow line many seconds.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class HandoffStats:
    """Counts and latencies shown in /server_info (bounded: the latest samples) and, with
    --enable-metrics, as Prometheus counters and histograms."""

    def __init__(self, role: str):
        self.role = role
        self.events: Counter = Counter()
        self.refused: Counter = Counter()
        self.handed_tokens = 0
        self.payload_bytes = 0
        # main: HandoffReady sent -> first tokens received; and -> last chunk absorbed.
        self.handoff_latency_s: deque = deque(maxlen=LATENCY_SAMPLES_KEPT)
        self.handoff_duration_s: deque = deque(maxlen=LATENCY_SAMPLES_KEPT)
        self._prometheus = None
        import os

        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import Counter as PromCounter
            from prometheus_client import Histogram

            self._prometheus = (
                PromCounter("pdd_handoff_events_total", "PDD handoff events", ["role", "event"]),
                PromCounter("pdd_handoff_refused_total", "PDD handoff messages or requests refused",
                            ["role", "reason"]),
                Histogram("pdd_handoff_latency_seconds", "PDD main: HandoffReady sent to the "
                          "relay's first tokens received", ["role"], buckets=LATENCY_BUCKETS_S),
                Histogram("pdd_handoff_duration_seconds", "PDD main: HandoffReady sent to the "
                          "last chunk absorbed", ["role"], buckets=LATENCY_BUCKETS_S),
            )

    def latency(self, seconds: float) -> None:
        self.handoff_latency_s.append(seconds)
        if self._prometheus:
            self._prometheus[2].labels(self.role).observe(seconds)

    def duration(self, seconds: float) -> None:
        self.handoff_duration_s.append(seconds)
        if self._prometheus:
            self._prometheus[3].labels(self.role).observe(seconds)

    def event(self, name: str, count: int = 1) -> None:
        self.events[name] += count
        if self._prometheus:
            self._prometheus[0].labels(self.role, name).inc(count)

    def refuse(self, reason: str) -> None:
        self.refused[reason] += 1
        if self._prometheus:
            self._prometheus[1].labels(self.role, reason).inc()

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
