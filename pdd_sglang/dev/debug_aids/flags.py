"""The ``--pdd-debug-*`` server flags: a namespace of SGLang's argument groups that only the debug
patch series adds (``patches/debug/0002``), so a production server refuses them as unknown flags.

Their checks run where the aids are installed (:func:`check`), in each scheduler process.
"""

from __future__ import annotations

from typing import Any

import msgspec
from sglang.srt.arg_groups.arg_utils import A


class PddDebugArgs(msgspec.Struct):
    """Namespace ``disagg.pdd_debug``: PDD's test and benchmark aids (``dev.debug_aids``)."""

    _NS_PATH = "disagg.pdd_debug"

    pdd_debug_corrupt_wan_kv: A[
        bool,
        "PDD debug (main): honour a request's test control corrupt_wan_kv, which changes one "
        "value of the KV the request received across the WAN before the digest is taken, to "
        "exercise --pdd-enable-kv-digest. For tests only.",
    ] = False
    pdd_debug_handoff_hold: A[
        bool,
        "PDD debug (relay): honour a request's test control handoff_after_tokens, which forces "
        "where the handoff happens (a route's handoff_mode forces how). For tests only.",
    ] = False
    pdd_debug_wan_delay_ms: A[
        int,
        "PDD debug (prefill): hold every KV chunk on the WAN path this many milliseconds before "
        "it is sent, so a test can make main's copy slow without a WAN emulator. For tests "
        "only. Default: 0.",
    ] = 0
    pdd_debug_wan_blocking_wait: A[
        bool,
        "PDD debug (prefill): wait on WAN copies inside Mooncake's synchronous batch call, "
        "which polls without sleeping (the behaviour before the asynchronous WAN path), so a "
        "benchmark can compare the two. For benchmarks only.",
    ] = False
    pdd_debug_kv_digest: A[
        bool,
        "PDD debug: hash each request's prompt KV on every server (prefill after its last "
        "chunk, relay and main once the transfer lands) and show the digests in /server_info. "
        "Reads every layer's rows: for tests only.",
    ] = False


def check(args: Any) -> None:
    """Refuse a debug flag's impossible value, by its name."""
    if getattr(args, "pdd_debug_wan_delay_ms", 0) < 0:
        raise ValueError(
            f"--pdd-debug-wan-delay-ms must be >= 0, got {args.pdd_debug_wan_delay_ms}")
