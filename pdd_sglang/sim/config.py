"""A simulated deployment: its setup (which baseline or PDD) and every knob of its cluster.

Setups (the report's baselines, and PDD's ablations):
  same_dc_pd         P and decode in one datacenter, all GPU-A, KV over RDMA.
  same_dc_hetero_pd  P on GPU-A, decode on GPU-B, one datacenter: what PDD's heterogeneity
                     competes with.
  cross_dc_pd        plain PD across the WAN: decode (GPU-B) behind the line, the whole prompt's
                     KV crosses it (no cache at decode).
  cross_dc_pd_drc    the same plus main's radix cache (DRC): only main's uncached suffix
                     crosses.  The DRC-only ablation.
  pdd                DRC + relay + handoff + singular filter: P and relay in A, main in B;
                     placement and handoff from pdd_sglang.policy.
  prld_only          the excluded variant: requests that would need hiding finish at the relay.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from ..policy import PolicyConfig
from ..policy.wan_order import BACKGROUND_IN_FLIGHT_S, CACHE_ONLY_BACKLOG_S


class Setup(enum.Enum):
    SAME_DC_PD = "same_dc_pd"
    SAME_DC_HETERO_PD = "same_dc_hetero_pd"
    CROSS_DC_PD = "cross_dc_pd"
    CROSS_DC_PD_DRC = "cross_dc_pd_drc"
    PDD = "pdd"
    RELAY_ONLY = "prld_only"

    @property
    def behind_wan(self) -> bool:
        """Main decodes in the other datacenter."""
        return self not in (Setup.SAME_DC_PD, Setup.SAME_DC_HETERO_PD)

    @property
    def has_drc(self) -> bool:
        """Main keeps a radix cache, so only its uncached suffix is shipped."""
        return self.behind_wan and self is not Setup.CROSS_DC_PD

    @property
    def has_relay(self) -> bool:
        return self in (Setup.PDD, Setup.RELAY_ONLY)

    @property
    def label(self) -> str:
        return SETUP_LABELS[self]


SETUP_LABELS = {
    Setup.SAME_DC_PD: "same-DC PD (GPU-A)",
    Setup.SAME_DC_HETERO_PD: "same-DC PD, GPU-B decode",
    Setup.CROSS_DC_PD: "cross-DC PD (naive)",
    Setup.CROSS_DC_PD_DRC: "cross-DC PD + DRC",
    Setup.PDD: "PDD",
    Setup.RELAY_ONLY: "P->RLD only",
}


PLACEMENTS = ("idle-line", "congestion-aware")
# "profile": main-bound copies share the WAN as its profile's copy_order says (fair, or in the
# order they started: the raw Mooncake sender before issue 34); "classed": issue 34's sender,
# one line per main, needed-now first, preemption at a slice boundary, cache-only copies
# dropped past a backlog (sim/wan_lines.py).
WAN_LINES = ("profile", "classed")


@dataclass(frozen=True)
class ClusterConfig:
    """One simulated deployment.  Decode runs on main_hardware, except in same_dc_pd, which is
    homogeneous (decode on prefill_hardware, or on same_dc_decode_hardware where given)."""

    setup: Setup = Setup.PDD
    model: str = "moe_1t_50kb"
    prefill_hardware: str = "gpu_a"
    relay_hardware: str = "gpu_a"
    main_hardware: str = "gpu_b"
    # same_dc_pd's decode server where it is not prefill's kind: the CPU demo runs it as a server
    # of its own under main's quota, so validate_sim.py scales it as main (None: prefill's).
    same_dc_decode_hardware: str | None = None
    wan_link: str = "wan_10g"
    rdma_link: str = "rdma_intra_dc"
    wan_bandwidth_scale: float = 1.0
    wan_window_bytes: float | None = None     # overrides the line's per-flow window (sweeps)
    wan_transfer_fixed_s: float | None = None # overrides the line's per-transfer fixed cost
    # configs/codecs/NAME.toml: main-bound WAN copies coded (issue 36), a lossless codec where
    # it shortens the copy (auto: policy.wan_codec), a lossy one always; None: raw.
    wan_codec: str | None = None
    prefill_instances: int = 2
    relay_instances: int = 1
    main_instances: int = 1
    relay_max_running: int = 32
    main_max_running: int = 256
    prefill_cache_tokens: int = 16_000_000    # HBM plus host-memory tier (HiCache), assumed
    main_cache_tokens: int = 16_000_000
    use_drc: bool | None = None               # None: the setup's own (Setup.has_drc)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    sample_interval_s: float = 5.0
    drain_limit_s: float = 1800.0             # stop this long after the last arrival
    seed: int = 0
    prefill_mfu: float | None = None          # overrides the prefill hardware's (sensitivity)
    # Latency every request pays before prefill that occupies no server; None: the prefill
    # hardware's dispatch_latency_s.  The operating point fits it (configs/operating_point.toml).
    dispatch_latency_s: float | None = None
    # The same for a request the router places through the relay before it posts to prefill (a
    # TTFT-budget placement): prefill starts once the relay, next door, has registered, and main
    # registers across the line meanwhile (the demo's PDD measured 8-9 ms of registration wait
    # at the latency point against cross-DC PD's 69-71 ms). None: dispatch_latency_s.
    relay_dispatch_latency_s: float | None = None
    # Parts of the demo's TTFT split that occupy no server (validate_sim.py calibrates them at
    # the latency point): the client -> router hop (the first router_to_prefill_s of the
    # dispatch latency; the rest is registration_wait) and router -> client after the first
    # token reaches the router (added to TTFT).
    router_to_prefill_s: float = 0.0
    router_to_client_s: float = 0.0
    # SGLang's schedulers act between forwards: the PD bootstrap waits for the decode side(s)
    # to be between steps before prefill starts, and main streams a landed request's first
    # token at its next step boundary.  False: neither waits (the GPU studies).
    register_at_step_boundary: bool = False
    # Every server on one machine (the CPU demo): forwards stretch by the hardware's
    # neighbour_slowdown per other busy server (servers.Host).
    shared_host: bool = False
    block_tokens: int = 512                   # prefix-cache granularity (the trace's 512)
    # "idle-line": place from the suffix's size on an idle line (policy.IDLE_LINE);
    # "congestion-aware": from the live line to that main (policy.LineState: bytes queued or in
    # flight to it, throughput measured over its recent copies).
    placement: str = "idle-line"
    # What the router was told of the line (its --wan-gbps as bytes/s, --wan-rtt-ms as s), as
    # the demo's router is; None: what it would configure from the line's own profile.
    router_wan_bytes_per_s: float | None = None
    router_wan_rtt_s: float | None = None
    # The router's --main-wait-for-landing-s (router/landing.py; its default): on P->RLD->MD a
    # turn reaches main only once the cache-only copy of the turn it extends, still crossing to
    # that main, has landed or was dropped, waiting at most this long, so main holds that
    # prefix and the line carries only the new suffix; 0: never wait.
    router_main_wait_for_landing_s: float = 20.0
    # How main-bound copies share the WAN (WAN_LINES). With "classed": the sender's slice
    # (None: prefill.wan_engine.window_for_line of the router's line, as the prefill sizes it
    # from its declared --pdd-wan-bandwidth-gbps / --pdd-wan-rtt-ms) and the backlog past which
    # queued cache-only copies are dropped (--pdd-wan-cache-only-backlog-s; None: never). The
    # sender's window is the line's per-flow window (wan_window_bytes or the profile's).
    wan_line: str = "profile"
    wan_slice_bytes: float | None = None
    wan_cache_only_backlog_s: float | None = CACHE_ONLY_BACKLOG_S
    # A background copy's most time in flight on the classed line (cache-only or relay-covered:
    # prefill.wan_engine.background_window); None: the window every copy keeps (the sender
    # before it).
    wan_background_in_flight_s: float | None = BACKGROUND_IN_FLIGHT_S

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.wan_line not in WAN_LINES:
            raise ValueError(f"wan_line must be one of {WAN_LINES}, got {self.wan_line!r}")

    @property
    def decode_hardware(self) -> str:
        if self.setup is Setup.SAME_DC_PD:
            return self.same_dc_decode_hardware or self.prefill_hardware
        return self.main_hardware

    @property
    def drc(self) -> bool:
        return self.setup.has_drc if self.use_drc is None else (self.use_drc and self.setup.behind_wan)

    def with_(self, **changes) -> "ClusterConfig":
        return replace(self, **changes)
