"""PDD's server flags, declared as a typed namespace of SGLang's own argument groups.

``patches/0001`` appends :class:`PddArgs` to SGLang's input namespaces, so ``--pdd-role`` and the
other PDD flags appear in ``python -m sglang.launch_server --help`` beside the PD flags, and are
resolved in SGLang's ``handle_pd_disaggregation`` step by :func:`resolve_pdd_server_args`.

A role is a deployment position, and each maps onto SGLang's own disaggregation mode:

=========  ======================  ==================================================
role       disaggregation mode     what it implies
=========  ======================  ==================================================
prefill    prefill                 fans KV out to relay and main
relay      decode                  no decode radix cache: a relay hides latency, it is not a cache
main       decode                  decode radix cache on (only the unmatched suffix crosses the WAN)
=========  ======================  ==================================================
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any, Literal, Optional

import msgspec
from sglang.srt.arg_groups.arg_utils import A

from pdd_sglang.policy.wan_order import CACHE_ONLY_BACKLOG_S

ROLE_TO_DISAGGREGATION_MODE = {"prefill": "prefill", "relay": "decode", "main": "decode"}
# The relay's control channel, beside SGLang's --disaggregation-bootstrap-port (8998), so that
# firewall rules can be written ahead (README, "Ports and addresses").
DEFAULT_CONTROL_PORT = 8999
# Mooncake is the transport PDD's dual-path transfer is built on (an RDMA engine beside P, a TCP
# engine across the WAN); other backends have no per-destination engine to configure.
PDD_TRANSFER_BACKENDS = ("mooncake", "mooncake_tcp")


class PddArgs(msgspec.Struct):
    """Namespace ``disagg.pdd``: cross-datacenter Prefill / Relay-decode / Main-decode."""

    _NS_PATH = "disagg.pdd"

    pdd_role: A[
        Optional[Literal["prefill", "relay", "main"]],
        "PDD (cross-datacenter PD) role of this server. 'prefill' runs as a PD prefill server; "
        "'relay' as a decode server beside prefill that decodes eagerly and hands off to main; "
        "'main' as a decode server across the WAN with the decode radix cache on. "
        "Implies --disaggregation-mode. Default: not a PDD server.",
    ] = None
    pdd_wan_transfer_protocol: A[
        Literal["tcp", "rdma"],
        "PDD prefill: Mooncake transport of the WAN path to main servers. The relay path uses "
        "SGLang's own engine (--disaggregation-transfer-backend, --disaggregation-ib-device). "
        "Default: tcp.",
    ] = "tcp"
    pdd_wan_ib_device: A[
        Optional[str],
        "PDD prefill: device for the WAN path's Mooncake engine (RDMA only). Default: none.",
    ] = None
    pdd_wan_transfer_timeout: A[
        int,
        "PDD prefill: seconds one batch of KV on the WAN path to a main may take before it "
        "fails. Enforced by the WAN engine itself (not MC_TRANSFER_TIMEOUT, which stays "
        "SGLang's for the relay path). Default: 120.",
    ] = 120
    pdd_wan_bandwidth_gbps: A[
        float,
        "PDD prefill and main: the WAN line's bandwidth to the mains, in Gbit/s, as leased. With "
        "--pdd-wan-rtt-ms it sizes each WAN copy's slices (four bandwidth-delay products) and "
        "window (twelve more in flight): enough to fill the line, and all a cancel or an urgent copy "
        "waits behind; and it scales the copies' deadlines on a line (first queued plus twice "
        "their time alone). At a main it sizes the staging rings (--pdd-wan-staging-mb). "
        "Default: 10.",
    ] = 10.0
    pdd_wan_rtt_ms: A[
        float,
        "PDD prefill and main: the WAN line's round-trip time to the mains, in ms. Default: 20.",
    ] = 20.0
    pdd_wan_window_mb: A[
        float,
        "PDD prefill: bytes (MiB) one WAN copy keeps in flight, in slices of at most 4 MiB, "
        "instead of what --pdd-wan-bandwidth-gbps x --pdd-wan-rtt-ms gives; 4 is the rule "
        "before windowed copies (one 4 MiB slice per round trip). Default: 0 (from the line).",
    ] = 0.0
    pdd_wan_cache_only_backlog_s: A[
        float,
        "PDD prefill: seconds of the WAN line (bytes ahead over its measured rate) past which a "
        "line's queued cache-only copies (their relay answered alone: they only warm main's "
        "cache) are dropped; prefill frees their KV and main is told, not taken out. 0: never "
        "drop. Default: 30 (policy.wan_order.CACHE_ONLY_BACKLOG_S).",
    ] = CACHE_ONLY_BACKLOG_S
    pdd_wan_kv_codec: A[
        Literal["auto", "raw", "lossless", "fp8", "one_sided"],
        "PDD prefill: how KV crosses the WAN to a main that offers a staging ring: as records "
        "packed into it, whatever the copy's size. 'auto' codes a copy losslessly (byte planes + "
        "zstd, bit-exact) where that shortens it on the line --pdd-wan-bandwidth-gbps declares "
        "(pdd_sglang.policy.wan_codec), else packs it raw; 'raw' and 'lossless' force one; 'fp8' "
        "(e4m3, a scale per row) is lossy: not token-exact, and refused with "
        "--pdd-enable-kv-digest; 'one_sided' writes raw KV straight into main's pages (one "
        "Mooncake request per KV buffer: on RDMA, where a raw copy's requests are large enough, "
        "that is what 'auto' and 'raw' do). Main lands records off its scheduler thread as they "
        "arrive. Default: auto.",
    ] = "auto"
    pdd_wan_staging_mb: A[
        float,
        "PDD main: MiB of host memory registered with its Mooncake engine that prefill ranks "
        "write packed KV records into: a ring of record slots for each of two prefill ranks, "
        "shared by their rooms and recycled as records land. 0: sized from the declared line "
        "(--pdd-wan-bandwidth-gbps x --pdd-wan-rtt-ms: slots of half a bandwidth-delay "
        "product, rings of 24, pdd_sglang.policy.wan_codec.staging_ring). Default: 0.",
    ] = 0.0
    pdd_relay_bootstrap_timeout: A[
        float,
        "PDD prefill: seconds to wait, after a main registers for a P->RLD->MD request, for its "
        "relay; past it the request goes to the main alone (and a late relay is refused). "
        "Default: 5.",
    ] = 5.0
    pdd_main_bootstrap_timeout: A[
        float,
        "PDD prefill: seconds to wait for a P->RLD->MD request's main after its relay "
        "registered (prefill starts on the relay alone); past it, once the relay has its KV, the "
        "relay answers alone, prefill frees the request's KV, and a late main is refused. "
        "Default: 30.",
    ] = 30.0
    pdd_control_port: A[
        int,
        "PDD relay: port of the relay <-> main control channel (ZMQ ROUTER, token-ID handoff), "
        "which mains in the other datacenter dial; bound on --host. 0 picks a free port. The "
        "router reads the address from /server_info. Default: "
        f"{DEFAULT_CONTROL_PORT}.",
    ] = DEFAULT_CONTROL_PORT
    pdd_advertise_host: A[
        Optional[str],
        "PDD: the address of this server that peers in the other datacenter dial (an IP or a "
        "name that resolves there). A relay advertises its control channel at it (needed with "
        "--host 0.0.0.0); a prefill its WAN engine (unless --pdd-wan-hostname) and, through "
        "/server_info, the bootstrap address the router gives mains. Sets SGLANG_HOST_IP, "
        "SGLang's address for its own KV sockets, when that is unset (so it must be an address "
        "of this host). Default: --host, or SGLANG_HOST_IP, or this host's name.",
    ] = None
    pdd_wan_hostname: A[
        Optional[str],
        "PDD prefill: host name or IP of the WAN path's Mooncake engine (the interface WAN "
        "traffic to mains leaves by, and the address mains see). Default: --pdd-advertise-host, "
        "else SGLang's own Mooncake engine's.",
    ] = None
    pdd_control_keypair: A[
        Optional[str],
        "PDD relay/main: this server's CURVE keypair file (NAME.key_secret from "
        "'python -m pdd_sglang.protocol.control_channel keygen'). Set it to authenticate and encrypt "
        "the control channel across the WAN. Default: plain channel.",
    ] = None
    pdd_control_authorized_keys: A[
        Optional[str],
        "PDD relay: directory of the public keys (*.key) of the mains allowed to connect. "
        "Required with --pdd-control-keypair on a relay.",
    ] = None
    pdd_control_relay_key: A[
        Optional[str],
        "PDD main: the relays' public key file (*.key). Required with --pdd-control-keypair "
        "on a main.",
    ] = None
    pdd_handoff_mode: A[
        Literal["auto", "one-shot", "catch-up"],
        "PDD relay: how eager tokens are handed to main. 'auto' picks One-Shot or Catch-Up "
        "per request from the relay's live load (pdd_sglang.policy). Default: auto.",
    ] = "auto"
    pdd_catch_up_threshold: A[
        int,
        "PDD relay: at or below this many held tokens a handoff is One-Shot. Default: 64.",
    ] = 64
    pdd_catch_up_chunk: A[
        int,
        "PDD relay: tokens per Catch-Up chunk. Default: 64.",
    ] = 64
    pdd_relay_load_watermark: A[
        float,
        "PDD relay: utilisation (running requests or KV, whichever is higher, 0-1) at or above "
        "which a handoff is One-Shot, to free the relay at once. Default: 0.7.",
    ] = 0.7
    pdd_handoff_timeout: A[
        float,
        "PDD main: seconds a main holds a request's KV waiting for its relay's tokens after "
        "saying it is ready; past it main decodes the request itself from the first token. "
        "Default: 30.",
    ] = 30.0
    pdd_enable_kv_digest: A[
        bool,
        "PDD relay/main: check the prompt KV main received across the WAN against the relay's "
        "copy (which came over the local path). Main sends a digest of the pages it received "
        "with HandoffReady, on the control channel (CURVE-authenticated when configured); on a "
        "mismatch the relay finishes the request itself and main drops its copy uncached. "
        "Hashes every received KV row on the CPU: set it on both relay and main. Default: off.",
    ] = False


# SGLang's decode holds an aborted request's pages until the prefill acks that nothing writes
# them any more, or until this timeout (default 30 s). A PDD prefill acks once its sender has
# waited out the copy's blocks in flight: each may take --pdd-wan-transfer-timeout, and a failed
# copy is waited out up to another (prefill/wan_engine.py), past which the fan-out calls the
# chunk stuck (+10 s). Main must hold the pages at least that long, or a late block of a WAN
# write lands in pages it gave to the next request.
# Mooncake's TCP transport (0.3.13) queues at most 1,024 requests per lane and peer, and fails a
# whole batch past that ("TCP lane queue-full rejection"). SGLang writes a chunk to a decode as
# one batch of one request per run of contiguous pages, per layer, K and V: a relay whose pool is
# fragmented (page size 1, long answers) gets thousands, and a 10-minute chaos soak lost 116 of
# 232 answers to it. 32,768 is the largest value Mooncake accepts (measured: 20,000 blocks in
# one batch land with it, fail without). The prefill sets it for its process (both engines)
# unless the operator has.
MOONCAKE_TCP_QUEUE_ENV = ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "32768")
DEFERRED_RELEASE_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
DEFERRED_RELEASE_MARGIN_S = 15.0


def hold_aborted_pages_past_wan_writes(wan_transfer_timeout_s: float) -> None:
    """A PDD decode's deferred release outlasts the prefill's worst case before its ack: set
    when unset, refused (naming both) when set shorter."""
    needed = 2 * float(wan_transfer_timeout_s) + DEFERRED_RELEASE_MARGIN_S
    given = os.environ.get(DEFERRED_RELEASE_ENV)
    if given is None:
        os.environ[DEFERRED_RELEASE_ENV] = repr(needed)  # the scheduler inherits it
        return
    try:
        seconds = float(given)
    except ValueError:
        raise PddConfigError(f"{DEFERRED_RELEASE_ENV}={given!r} is not a number of seconds")
    if seconds < needed:
        raise PddConfigError(
            f"{DEFERRED_RELEASE_ENV}={given}: a PDD decode must hold an aborted request's pages "
            f"at least {needed:g} s (2 x --pdd-wan-transfer-timeout {wan_transfer_timeout_s:g} "
            f"+ {DEFERRED_RELEASE_MARGIN_S:g}), as long as a WAN write to them may still land; "
            "raise it, or lower --pdd-wan-transfer-timeout")


class PddConfigError(ValueError):
    """A PDD flag contradicts another flag; the message names both."""


def resolve_pdd_server_args(server_args: Any) -> None:
    """Map ``--pdd-role`` onto SGLang's PD flags, or refuse contradictions.

    Runs first in SGLang's ``handle_pd_disaggregation`` step, before anything reads
    ``disaggregation_mode``. Only decisions are declared (SGLang's ``declare_resolution``); the
    user's raw inputs are left as given, so ``/server_info`` shows both.
    """
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    cfg = resolving_view(server_args)
    role = cfg.pdd_role
    if role is None:
        return
    decisions = _decide(
        role=role,
        disaggregation_mode=cfg.disaggregation_mode,
        transfer_backend=cfg.disaggregation_transfer_backend,
        decode_radix_cache=cfg.disaggregation_decode_enable_radix_cache,
        disable_overlap_schedule=cfg.disable_overlap_schedule,
    )
    _check_handoff_flags(cfg)
    check_address_flags(cfg.pdd_advertise_host, cfg.pdd_wan_hostname)
    if cfg.pdd_advertise_host and not os.environ.get("SGLANG_HOST_IP"):
        # SGLang's bootstrap registration and Mooncake session advertise this address; the
        # scheduler and its children inherit it from the launcher.
        os.environ["SGLANG_HOST_IP"] = cfg.pdd_advertise_host
    if role in ("relay", "main"):
        hold_aborted_pages_past_wan_writes(cfg.pdd_wan_transfer_timeout)
    else:
        os.environ.setdefault(*MOONCAKE_TCP_QUEUE_ENV)  # the scheduler inherits it
    check_parallelism(role, pp_size=cfg.pp_size, dp_size=cfg.dp_size,
                      enable_dp_attention=cfg.enable_dp_attention,
                      staging_buffer=_staging_buffer_enabled())
    check_transfer_engine()
    if cfg.pdd_wan_transfer_timeout <= 0:
        raise PddConfigError(
            f"--pdd-wan-transfer-timeout must be positive, got {cfg.pdd_wan_transfer_timeout}"
        )
    if decisions:
        declare_resolution(server_args, "resolve_pdd_server_args", **decisions)


# TP runs (issues 23, 37): the handoff's control channel lives on TP rank 0 and its inputs reach
# every rank each step (pdd_sglang.decode.tp_sync); prefill, relay and main may run different TP
# sizes that SGLang's PD pairs (the fan-out refuses others at bootstrap:
# pdd_sglang.protocol.messages.tp_refusal); the KV digest combines every rank's heads.
_UNSUPPORTED_PARALLELISM = {
    "dp_size": "--dp-size {value}: PDD does not support data parallelism inside one server (each "
               "DP replica's scheduler would run its own rooms and handoff control channel, and "
               "the router reads only the first scheduler's state); run one server per replica "
               "behind the PDD router, or leave --pdd-role out",
    "pp_size": "--pp-size {value}: PDD does not support pipeline parallelism; run --pp-size 1 or "
               "leave --pdd-role out",
    "enable_dp_attention": "--enable-dp-attention: PDD does not support DP attention (its rooms "
                           "and handoffs assume one scheduler); drop the flag or leave "
                           "--pdd-role out",
    "staging_buffer": "SGLANG_DISAGG_STAGING_BUFFER=1: PDD's per-destination sending does not "
                      "support SGLang's staging buffer; unset it or leave --pdd-role out",
}


def check_parallelism(role: str, *, pp_size: int = 1, dp_size: int = 1,
                      enable_dp_attention: bool = False, staging_buffer: bool = False) -> None:
    """Refuse, one clear message each, what PDD does not support yet (issue 14, item 2)."""
    given = {"dp_size": dp_size if dp_size != 1 and not enable_dp_attention else None,
             "pp_size": pp_size if pp_size != 1 else None,
             "enable_dp_attention": True if enable_dp_attention else None,
             "staging_buffer": True if staging_buffer else None}
    for key, value in given.items():
        if value is not None:
            raise PddConfigError(f"--pdd-role {role} with "
                                 + _UNSUPPORTED_PARALLELISM[key].format(value=value))


def _staging_buffer_enabled() -> bool:
    from sglang.srt.environ import envs

    return bool(envs.SGLANG_DISAGG_STAGING_BUFFER.get())


def check_transfer_engine(import_engine=None) -> None:
    """Fail at start, in one line, if Mooncake's transfer engine cannot load.

    Without this, a missing shared library surfaces minutes later as a traceback deep inside the
    scheduler's KV manager. The import runs in a child interpreter (about 0.1 s): the launcher
    itself never uses the engine, and loading it there would start the Go runtime Mooncake
    embeds (five threads) in the process that then starts SGLang's scheduler.
    """
    if import_engine is None:
        import_engine = _import_engine_in_a_child
    try:
        import_engine()
    except ImportError as err:
        if "libibverbs" in str(err):
            raise PddConfigError(
                "Mooncake's transfer engine needs libibverbs.so.1, even over TCP; install the "
                "Debian package libibverbs1 (make setup does it)."
            ) from err
        raise PddConfigError(
            f"Mooncake's transfer engine could not be imported ({err}). Install the CPU profile "
            "(mooncake-transfer-engine-non-cuda) or the GPU one (mooncake-transfer-engine) with "
            "make setup."
        ) from err


def _import_engine_in_a_child() -> None:
    child = subprocess.run([sys.executable, "-c", "import mooncake.engine"],
                           capture_output=True, text=True)
    if child.returncode != 0:
        lines = child.stderr.strip().splitlines()
        raise ImportError(lines[-1] if lines else f"exit code {child.returncode}")


WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "*")


def check_address_flags(advertise_host: Optional[str], wan_hostname: Optional[str],
                        resolve=socket.getaddrinfo) -> None:
    """An address peers dial must be one host, not a wildcard, a URL or host:port, and resolve."""
    for flag, value in (("--pdd-advertise-host", advertise_host),
                        ("--pdd-wan-hostname", wan_hostname)):
        if value is None:
            continue
        if not value.strip() or value != value.strip() or any(c.isspace() for c in value):
            raise PddConfigError(f"{flag} must be a host name or IP address, got {value!r}")
        if value in WILDCARD_HOSTS:
            raise PddConfigError(
                f"{flag} {value}: a wildcard is what a server binds, not an address a peer can "
                "dial; give this host's address as the other datacenter reaches it")
        if "/" in value or value.count(":") == 1:
            raise PddConfigError(
                f"{flag} {value!r}: give the host alone (no scheme, path or port); the ports "
                "have their own flags (--pdd-control-port, --disaggregation-bootstrap-port)")
        try:
            resolve(value, None)
        except (socket.gaierror, UnicodeError) as err:
            raise PddConfigError(f"{flag} {value!r} does not resolve on this host ({err})") from err


def _check_handoff_flags(cfg: Any) -> None:
    if not 0 <= cfg.pdd_control_port <= 65535:
        raise PddConfigError(f"--pdd-control-port must be 0-65535, got {cfg.pdd_control_port}")
    if cfg.pdd_catch_up_threshold < 0 or cfg.pdd_catch_up_chunk < 1:
        raise PddConfigError(
            "--pdd-catch-up-threshold must be >= 0 and --pdd-catch-up-chunk >= 1, got "
            f"{cfg.pdd_catch_up_threshold} and {cfg.pdd_catch_up_chunk}"
        )
    if cfg.pdd_relay_load_watermark < 0:
        raise PddConfigError(
            f"--pdd-relay-load-watermark must be >= 0, got {cfg.pdd_relay_load_watermark}"
        )
    for flag in ("pdd_wan_bandwidth_gbps", "pdd_wan_rtt_ms"):
        if not getattr(cfg, flag) > 0:
            raise PddConfigError(
                f"--{flag.replace('_', '-')} must be positive, got {getattr(cfg, flag)}")
    if cfg.pdd_wan_cache_only_backlog_s < 0:
        raise PddConfigError("--pdd-wan-cache-only-backlog-s must be >= 0, got "
                             f"{cfg.pdd_wan_cache_only_backlog_s}")
    if cfg.pdd_wan_window_mb < 0:
        raise PddConfigError(f"--pdd-wan-window-mb must be >= 0, got {cfg.pdd_wan_window_mb}")
    if cfg.pdd_wan_staging_mb < 0:
        raise PddConfigError(f"--pdd-wan-staging-mb must be >= 0, got {cfg.pdd_wan_staging_mb}")
    if cfg.pdd_wan_kv_codec == "fp8" and cfg.pdd_enable_kv_digest:
        raise PddConfigError(
            "--pdd-wan-kv-codec fp8 with --pdd-enable-kv-digest: FP8 is lossy, so main's copy "
            "would never match the relay's and every handoff would fail its digest; use "
            "--pdd-wan-kv-codec lossless (bit-exact) or drop the digest")
    for flag in ("pdd_relay_bootstrap_timeout", "pdd_main_bootstrap_timeout"):
        if getattr(cfg, flag) <= 0:
            raise PddConfigError(
                f"--{flag.replace('_', '-')} must be positive, got {getattr(cfg, flag)}")
    if cfg.pdd_handoff_timeout <= 0:
        raise PddConfigError(f"--pdd-handoff-timeout must be positive, got {cfg.pdd_handoff_timeout}")
    if cfg.pdd_control_keypair is not None:
        needed = {"relay": ("--pdd-control-authorized-keys", cfg.pdd_control_authorized_keys),
                  "main": ("--pdd-control-relay-key", cfg.pdd_control_relay_key)}.get(cfg.pdd_role)
        if needed is not None and needed[1] is None:
            raise PddConfigError(
                f"--pdd-control-keypair on a {cfg.pdd_role} needs {needed[0]} as well"
            )


def _decide(
    *, role: str, disaggregation_mode: str, transfer_backend: str, decode_radix_cache: bool,
    disable_overlap_schedule: bool = True,
) -> dict:
    """Pure decision table behind :func:`resolve_pdd_server_args` (unit-tested directly)."""
    if role not in ROLE_TO_DISAGGREGATION_MODE:
        raise PddConfigError(
            f"--pdd-role {role!r} is unknown; choose one of {sorted(ROLE_TO_DISAGGREGATION_MODE)}"
        )
    mode = ROLE_TO_DISAGGREGATION_MODE[role]
    decisions: dict = {}
    if disaggregation_mode == "null":
        decisions["disaggregation_mode"] = mode
    elif disaggregation_mode != mode:
        raise PddConfigError(
            f"--pdd-role {role} runs as a PD {mode} server, but --disaggregation-mode "
            f"{disaggregation_mode} was given. Drop --disaggregation-mode (the role implies it) "
            f"or set it to {mode}."
        )
    if transfer_backend not in PDD_TRANSFER_BACKENDS:
        raise PddConfigError(
            f"--pdd-role {role} needs a Mooncake transfer backend, but "
            f"--disaggregation-transfer-backend {transfer_backend} was given. Use "
            f"{' or '.join(PDD_TRANSFER_BACKENDS)}."
        )
    if role == "relay" and decode_radix_cache:
        raise PddConfigError(
            "--pdd-role relay keeps no long-lived cache (it only hides WAN latency), but "
            "--disaggregation-decode-enable-radix-cache was given. Drop that flag on the relay; "
            "the decode radix cache belongs on --pdd-role main."
        )
    if role == "main" and not decode_radix_cache:
        decisions["disaggregation_decode_enable_radix_cache"] = True
    if role in ("relay", "main") and not disable_overlap_schedule:
        # The handoff finishes (relay) and extends (main) requests between two scheduler
        # steps; with the overlap loop a step is still in flight there. Not yet supported.
        decisions["disable_overlap_schedule"] = True
    return decisions
