"""A relay or main decode server introduces itself to prefill for each PDD room.

Life cycle of a request on a PDD decode server (relay or main), up to its KV arriving:

1. SGLang's decode scheduler creates the request's KV receiver; :func:`attach_route` reads the
   request's PDD route from its ``kv_hints`` and keeps it on the receiver.
2. When the receiver sends its transfer metadata (after matching its radix cache and allocating
   the rest), :func:`receiver_metadata` multiplies SGLang's required destination count by the
   number of decode servers on the route, and appends a ``DestinationHello`` naming this
   server's role, its prefix and its attention TP size, so prefill waits for every rank of both,
   and sends each only what it lacks. At TP > 1 every rank sends its own hello to the prefill
   ranks SGLang pairs it with (at equal TP the rank of its index; at another TP size by whole
   ratios, each rank getting its own heads): ranks' radix trees agree (same requests, same
   steps), so each claims the same prefix. Prefill refuses only sizes it cannot pair with.
3. Prefill reports "transfer done" to each destination as its own part lands
   (:mod:`pdd_sglang.prefill.fanout`); from there SGLang's decode path takes over.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from pdd_sglang.protocol.messages import DestinationHello, encode, tp_refusal
from pdd_sglang.protocol.route import RouteError, route_of

logger = logging.getLogger(__name__)


def this_server_role() -> str | None:
    from sglang.srt.runtime_context import get_server_args

    return getattr(get_server_args(), "pdd_role", None)


def attach_route(receiver: Any, req: Any) -> None:
    receiver.pdd_request = weakref.ref(req)  # its staged copy's request (seam.main_staged_kv)
    try:
        receiver.pdd_route = route_of(getattr(req, "kv_hints", None))
    except RouteError as err:
        # A malformed route must not silently become plain PD on one side only.
        logger.error("PDD: request %s has a bad route (%s); aborting it", req.rid, err)
        receiver.pdd_route = None
        req.set_finish_with_abort(f"PDD route refused: {err}")


def receiver_metadata(receiver: Any, decode_prefix_len: int | None,
                      kv_indices: Any = None) -> tuple[int, list]:
    """``(required_dst_info_num, extra_frames)`` for this receiver's metadata message."""
    route = getattr(receiver, "pdd_route", None)
    role = this_server_role()
    if route is None or role not in ("relay", "main"):
        return receiver.required_dst_info_num, []
    tp_size = int(getattr(receiver.kv_mgr, "attn_tp_size", 1) or 1)
    prefill_tp = getattr(getattr(receiver, "prefill_info", None), "attn_tp_size", None)
    refusal = None if prefill_tp is None else tp_refusal(role, tp_size, int(prefill_tp))
    if refusal is not None:  # prefill refuses the hello
        logger.error("PDD: room %s will fail: %s", receiver.bootstrap_room, refusal)
    ring = None
    if role == "main" and kv_indices is not None and prefill_tp == tp_size:
        # Packed KV (issues 36, 50) only where one prefill rank writes this rank's whole pages.
        staging = staging_for(receiver.kv_mgr)
        if staging is not None:
            ring = staging.offer(receiver, int(receiver.bootstrap_room), kv_indices,
                                 str(getattr(receiver, "bootstrap_addr", "")))
    hello = DestinationHello(
        room=int(receiver.bootstrap_room),
        role=role,
        destinations=route.destinations,
        prefix_tokens=int(decode_prefix_len or 0),
        tp_size=tp_size,
        staging_addr=ring.addr if ring is not None else 0,
        staging_bytes=ring.nbytes if ring is not None else 0,
        staging_slot_bytes=ring.slot_bytes if ring is not None else 0,
    )
    return receiver.required_dst_info_num * route.destinations, [encode(hello)]


_NO_STAGING = object()


def staging_for(kv_mgr: Any) -> Any:
    """The main's staging region (:mod:`pdd_sglang.decode.wan_staging`), made and registered
    with its Mooncake engine on first use: rings sized from the declared line
    (``--pdd-wan-bandwidth-gbps`` x ``--pdd-wan-rtt-ms``), or ``--pdd-wan-staging-mb`` when
    set; None when it cannot be made (then every copy to this main goes one-sided)."""
    staging = getattr(kv_mgr, "pdd_staging", _NO_STAGING)
    if staging is _NO_STAGING:
        from sglang.srt.runtime_context import get_server_args

        from pdd_sglang.decode.wan_staging import MainStaging
        from pdd_sglang.policy.wan_codec import RINGS_PER_MAIN, staging_ring

        args = get_server_args()
        staging = None
        try:
            slot, ring = staging_ring(float(args.pdd_wan_bandwidth_gbps),
                                      float(args.pdd_wan_rtt_ms),
                                      float(getattr(args, "pdd_wan_staging_mb", 0) or 0))
            staging = MainStaging(kv_mgr, RINGS_PER_MAIN * ring, ring, slot,
                                  str(getattr(args, "device", "cpu")))
            logger.info("PDD: main's staging region for packed WAN KV: %d rings of %.1f MiB "
                        "(slots of %.2f MiB) at %#x", RINGS_PER_MAIN, ring / (1 << 20),
                        slot / (1 << 20), staging.addr)
        except Exception:  # a main that cannot stage still serves one-sided copies
            logger.exception("PDD: main's staging region could not be made; every WAN copy "
                             "to this main goes one-sided")
        kv_mgr.pdd_staging = staging
    return staging


def concluding(receiver: Any, status: Any) -> Any:
    """The receiver's room concluded (``status`` Success or Failed), seen on the scheduler
    thread: a packed copy counts as landed once the landing thread has scattered every record
    (Transferring until then), or the room fails."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from pdd_sglang.decode.wan_staging import LANDED, PENDING

    staging = getattr(receiver.kv_mgr, "pdd_staging", None)
    if staging is None or staging is _NO_STAGING:
        return status
    room = int(receiver.bootstrap_room)
    outcome = staging.land(room, status == KVPoll.Success)
    if outcome is None or outcome == LANDED:
        return status
    if outcome == PENDING:
        return KVPoll.Transferring  # asked again at the poll's next round
    receiver.kv_mgr.record_failure(room, outcome)
    receiver.kv_mgr.update_status(room, KVPoll.Failed)
    return KVPoll.Failed


def cleared(receiver: Any) -> None:
    """SGLang clears the receiver before the room's pages go elsewhere: the landing thread lets
    the room go first (scheduler thread)."""
    staging = getattr(receiver.kv_mgr, "pdd_staging", None)
    if staging is not None and staging is not _NO_STAGING:
        staging.forget(int(receiver.bootstrap_room))
