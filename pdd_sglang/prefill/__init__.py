"""The prefill role: the fan-out that sends one request's KV to relay and main, each past its own
prefix (:mod:`~pdd_sglang.prefill.fanout`), its senders and WAN path, and the transfer ledger.

Its parts of ``/server_info`` are registered with :mod:`pdd_sglang.diagnostics.server_info` here,
on import of the package: the transfer ledger (``transfers``), and from the KV manager's fan-out,
when this server runs one, its WAN line (``wan_line``), its published view (``fanout``) and its
WAN codec's figures (``wan_codec``).
"""

from typing import Any

from pdd_sglang.diagnostics.server_info import register_state


def _transfers(scheduler: Any, kv_mgr: Any) -> dict:
    from pdd_sglang.prefill.ledger import LEDGER

    return LEDGER.snapshot()


def _wan_line(scheduler: Any, kv_mgr: Any) -> dict | None:
    """Prefill's WAN line per main Mooncake session (congestion-aware placement reads it)."""
    fanout = getattr(kv_mgr, "pdd_fanout", None)
    return None if fanout is None else fanout.wan_line.snapshot()


def _fanout(scheduler: Any, kv_mgr: Any) -> dict | None:
    """The fan-out's counters, open rooms and mains out (its owner's published view)."""
    fanout = getattr(kv_mgr, "pdd_fanout", None)
    return None if fanout is None else fanout.published


def _wan_codec(scheduler: Any, kv_mgr: Any) -> dict | None:
    """``--pdd-wan-kv-codec`` and what it did: copies coded and raw, their KV and wire bytes,
    the lossless codec's running ratio and encode rate (issue 36), and the send pool's bytes
    (held, at most) once a packed copy made it."""
    fanout = getattr(kv_mgr, "pdd_fanout", None)
    choice = getattr(fanout, "codec_choice", None)
    if choice is None:
        return None
    pool = getattr(getattr(fanout, "wan_engine", None), "send_pool", None)
    return {**choice.state(), **({"send_pool": pool.state()} if pool is not None else {})}


register_state("transfers", _transfers)
register_state("wan_codec", _wan_codec)
register_state("wan_line", _wan_line)
register_state("fanout", _fanout)
