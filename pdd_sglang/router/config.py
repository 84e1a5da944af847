"""Router settings and the command line: servers by role, link parameters, policy knobs, timeouts."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Optional, Sequence

from pdd_sglang.policy import PolicyConfig

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's default --disaggregation-bootstrap-port
# Link defaults: a leased 10 Gbps inter-datacenter line with 20 ms RTT (the brief's range is
# 10-100 Gbps and milliseconds to tens of milliseconds; the conservative end).
DEFAULT_WAN_GBPS = 10.0
DEFAULT_WAN_RTT_MS = 20.0
PLACEMENTS = ("congestion-aware", "idle-line")


@dataclass(frozen=True)
class PrefillEndpoint:
    url: str
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT


@dataclass(frozen=True)
class LinkParams:
    """What the placement predicts WAN time from (policy.predict_wan_seconds)."""

    wan_bytes_per_s: float
    rtt_s: float
    # None: computed from the model's config once it is known (ModelInfo.kv_bytes_per_token).
    kv_bytes_per_token: Optional[float] = None


@dataclass(frozen=True)
class RouterConfig:
    prefills: tuple[PrefillEndpoint, ...]
    relays: tuple[str, ...]
    mains: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 30000
    link: LinkParams = LinkParams(DEFAULT_WAN_GBPS * 1e9 / 8, DEFAULT_WAN_RTT_MS / 1e3)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    tokenizer_path: Optional[str] = None  # default: the servers' tokenizer path from /model_info
    mirror_max_tokens: Optional[int] = None  # default: main's KV pool size
    health_interval_s: float = 5.0
    health_failures_to_remove: int = 2
    connect_timeout_s: float = 10.0
    # Longest silence tolerated on an upstream stream (a decode step, or the WAN copy before main's
    # first token) before the request is failed and aborted everywhere.
    read_timeout_s: float = 600.0
    startup_timeout_s: float = 600.0
    incremental_streaming_output: bool = False
    # On P->RLD->MD, how long main's request may wait for the previous turn's WAN copy to land
    # (router/landing.py). Keep it under the prefill's --pdd-main-bootstrap-timeout.
    main_wait_for_landing_s: float = 20.0
    # A request that fails before the client has any of its answer (a server died, a transfer
    # failed) is placed again and re-sent, at most this many times.
    retry_max_retries: int = 1
    # ... and one that fails after the client got part of it goes on from its last token.
    retry_after_first_token: bool = False
    # After a relay was lost mid-answer and main's copy of the prompt has landed, how long main
    # may stay silent before the router aborts its copy and continues the request from the
    # client's last token on a fresh placement (router/relay_loss.py). Main that saw the relay
    # go answers within a decode step; one that never connected to it waits for its
    # --pdd-handoff-timeout.
    relay_loss_main_grace_s: float = 1.0
    # How placement predicts main's WAN time: "congestion-aware" behind the bytes the line to
    # that main already carries, at its measured rate (router/line_state.py); "idle-line" as if
    # the line were idle.
    placement: str = "congestion-aware"


def _split_prefill_args(values: Sequence[str]) -> tuple[PrefillEndpoint, ...]:
    """``--prefill URL [PORT] URL [PORT] ...`` as SGLang's router takes it."""
    endpoints, index = [], 0
    while index < len(values):
        url = values[index]
        if not url.startswith(("http://", "https://")):
            raise argparse.ArgumentTypeError(f"--prefill expects a URL first, got {url!r}")
        port = DEFAULT_BOOTSTRAP_PORT
        if index + 1 < len(values) and values[index + 1].isdigit():
            port = int(values[index + 1])
            index += 1
        endpoints.append(PrefillEndpoint(url.rstrip("/"), port))
        index += 1
    return tuple(endpoints)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pdd_sglang.router",
        description="PDD router: places each request on P->MD or P->RLD->MD and splices streams.")
    parser.add_argument("--prefill", nargs="+", action="append", required=True, metavar="URL [PORT]",
                        help="prefill server URL, optionally followed by its bootstrap port "
                             f"(default {DEFAULT_BOOTSTRAP_PORT}); repeatable")
    parser.add_argument("--relay", nargs="+", action="append", default=[], metavar="URL",
                        help="relay decode server URL(s); none: every request is P->MD")
    parser.add_argument("--main", nargs="+", action="append", required=True, metavar="URL",
                        help="main decode server URL(s)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--wan-gbps", type=float, default=DEFAULT_WAN_GBPS,
                        help="WAN bandwidth available to one request's KV copy, Gbit/s")
    parser.add_argument("--wan-rtt-ms", type=float, default=DEFAULT_WAN_RTT_MS)
    parser.add_argument("--kv-bytes-per-token", type=float, default=None,
                        help="KV bytes one token costs on the wire (default: 2 x layers x KV "
                             "heads x head dim x dtype size, from the model's config; set it "
                             "for MLA or compressed KV)")
    parser.add_argument("--hide-wan-below-s", type=float, default=PolicyConfig.hide_wan_below_s,
                        help="without a TTFT budget (--ttft-slo-ms): P->MD when main's predicted "
                             "WAN time is under this, else P->RLD->MD")
    parser.add_argument("--ttft-slo-ms", type=float, default=None,
                        help="TTFT budget: P->MD only when the TTFT predicted through main "
                             "(prefill queue, prefill, WAN copy) fits it, else P->RLD->MD while a "
                             "relay has headroom, else P->MD counted over budget "
                             "(pdd_router_ttft_budget); a request's own \"ttft_slo_ms\" wins. "
                             "Unset: --hide-wan-below-s decides")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=None,
                        help="prefill throughput, for the queue and prefill parts of that "
                             "prediction (unset: only the WAN copy is predicted)")
    parser.add_argument("--relay-full-utilisation", type=float,
                        default=PolicyConfig.relay_full_utilisation,
                        help="a relay with this share of its request slots taken by the "
                             "router has no headroom for the TTFT budget")
    parser.add_argument("--main-load-penalty-tokens", type=int,
                        default=PolicyConfig.main_load_penalty_tokens,
                        help="a fully loaded main is worth this many cached tokens less")
    parser.add_argument("--singular-predictive", action="store_true",
                        help="send long-uncached, short-output requests to the relay alone")
    parser.add_argument("--singular-min-uncached-tokens", type=int,
                        default=PolicyConfig.singular_min_uncached_tokens,
                        help="singular traffic: at least this many uncached prompt tokens ...")
    parser.add_argument("--singular-max-new-tokens", type=int,
                        default=PolicyConfig.singular_max_new_tokens,
                        help="... and at most this many output tokens; when the relay answers "
                             "such a request alone, main's WAN copy is cancelled too")
    parser.add_argument("--placement", choices=PLACEMENTS, default="congestion-aware",
                        help="predict main's WAN time behind the copies already on the line to "
                             "it, at the rate measured over recent copies (congestion-aware), "
                             "or as if the line were idle (idle-line)")
    parser.add_argument("--tokenizer-path", default=None)
    parser.add_argument("--mirror-max-tokens", type=int, default=None,
                        help="tokens per main's prefix mirror (default: main's KV pool size)")
    parser.add_argument("--health-interval-s", type=float, default=5.0)
    parser.add_argument("--health-failures-to-remove", type=int, default=2)
    parser.add_argument("--connect-timeout-s", type=float, default=10.0)
    parser.add_argument("--read-timeout-s", type=float, default=600.0)
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--main-wait-for-landing-s", type=float, default=20.0,
                        help="on P->RLD->MD, send a turn to main only once the WAN copy of the "
                             "turn it extends has landed there, waiting at most this long (keep "
                             "it under the prefill's --pdd-main-bootstrap-timeout); 0: never wait")
    parser.add_argument("--retry-max-retries", type=int, default=1,
                        help="re-send a request that failed before the client got any token (a "
                             "server died, a KV transfer failed), placed afresh, at most this "
                             "many times; 0: never")
    parser.add_argument("--retry-after-first-token", action="store_true",
                        help="also retry a request that failed after the client got part of "
                             "its answer, as a continuation from the last token it got (greedy: "
                             "the same answer; sampled: a valid continuation, not the same draw)")
    parser.add_argument("--relay-loss-main-grace-s", type=float, default=1.0,
                        help="after a relay died mid-answer and main's copy of the prompt has "
                             "landed, how long main may stay silent before the router aborts "
                             "its copy and continues the request from the client's last token "
                             "on a fresh placement (main that never connected to the relay "
                             "would wait for its --pdd-handoff-timeout)")
    parser.add_argument("--incremental-streaming-output", action="store_true",
                        help="stream only new text and ids per /generate chunk (as SGLang's flag)")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> RouterConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        prefills = _split_prefill_args([v for group in args.prefill for v in group])
    except argparse.ArgumentTypeError as err:
        parser.error(str(err))
    flat = lambda groups: tuple(v.rstrip("/") for group in groups for v in group)  # noqa: E731
    if args.wan_gbps <= 0:
        parser.error("--wan-gbps must be > 0")
    if args.retry_max_retries < 0:
        parser.error("--retry-max-retries must be >= 0")
    if args.relay_loss_main_grace_s < 0:
        parser.error("--relay-loss-main-grace-s must be >= 0")
    for flag, value in (("--ttft-slo-ms", args.ttft_slo_ms),
                        ("--prefill-tokens-per-s", args.prefill_tokens_per_s),
                        ("--relay-full-utilisation", args.relay_full_utilisation)):
        if value is not None and not value > 0:
            parser.error(f"{flag} must be > 0")
    policy = PolicyConfig(hide_wan_below_s=args.hide_wan_below_s,
                          ttft_slo_s=None if args.ttft_slo_ms is None else args.ttft_slo_ms / 1e3,
                          prefill_tokens_per_s=args.prefill_tokens_per_s,
                          relay_full_utilisation=args.relay_full_utilisation,
                          main_load_penalty_tokens=args.main_load_penalty_tokens,
                          singular_predictive=args.singular_predictive,
                          singular_min_uncached_tokens=args.singular_min_uncached_tokens,
                          singular_max_new_tokens=args.singular_max_new_tokens)
    return RouterConfig(
        prefills=prefills, relays=flat(args.relay), mains=flat(args.main),
        host=args.host, port=args.port,
        link=LinkParams(args.wan_gbps * 1e9 / 8, args.wan_rtt_ms / 1e3, args.kv_bytes_per_token),
        policy=policy, tokenizer_path=args.tokenizer_path,
        mirror_max_tokens=args.mirror_max_tokens, health_interval_s=args.health_interval_s,
        health_failures_to_remove=args.health_failures_to_remove,
        connect_timeout_s=args.connect_timeout_s, read_timeout_s=args.read_timeout_s,
        startup_timeout_s=args.startup_timeout_s,
        incremental_streaming_output=args.incremental_streaming_output,
        main_wait_for_landing_s=args.main_wait_for_landing_s,
        retry_max_retries=args.retry_max_retries,
        retry_after_first_token=args.retry_after_first_token,
        relay_loss_main_grace_s=args.relay_loss_main_grace_s,
        placement=args.placement,
    )
