"""Build a decode server's control loop and handoff settings from its PDD flags."""

from __future__ import annotations

import socket
from collections import Counter
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


class HandoffStats:
    """Counts shown in /server_info and, with --enable-metrics, as Prometheus counters."""

    def __init__(self, role: str):
        self.role = role
        self.events: Counter = Counter()
        self.refused: Counter = Counter()
        self.handed_tokens = 0
        self.payload_bytes = 0
        self.handoff_latency_s: list[float] = []  # main: HandoffReady sent -> extend scheduled
        self._prometheus = None
        import os

        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import Counter as PromCounter

            self._prometheus = (
                PromCounter("pdd_handoff_events_total", "PDD handoff events", ["role", "event"]),
                PromCounter("pdd_handoff_refused_total", "PDD handoff messages or requests refused",
                            ["role", "reason"]),
            )

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
        latencies = sorted(self.handoff_latency_s)
        return {
            "role": self.role,
            "control_address": loop.address,
            "events": dict(self.events),
            "refused": dict(refused),
            "handed_tokens": self.handed_tokens,
            "payload_bytes": self.payload_bytes,
            "handoff_latency_ms": [round(s * 1e3, 3) for s in latencies[-256:]],
        }
