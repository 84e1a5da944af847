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
from typing import Any

from pdd_sglang.protocol.messages import DestinationHello, encode, tp_refusal
from pdd_sglang.protocol.route import RouteError, route_of

logger = logging.getLogger(__name__)


def this_server_role() -> str | None:
    from sglang.srt.runtime_context import get_server_args

    return getattr(get_server_args(), "pdd_role", None)


def attach_route(receiver: Any, req: Any) -> None:
    try:
        receiver.pdd_route = route_of(getattr(req, "kv_hints", None))
    except RouteError as err:
        # A malformed route must not silently become plain PD on one side only.
        logger.error("PDD: request %s has a bad route (%s); aborting it", req.rid, err)
        receiver.pdd_route = None
        req.set_finish_with_abort(f"PDD route refused: {err}")


def receiver_metadata(receiver: Any, decode_prefix_len: int | None) -> tuple[int, list]:
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
    hello = DestinationHello(
        room=int(receiver.bootstrap_room),
        role=role,
        destinations=route.destinations,
        prefix_tokens=int(decode_prefix_len or 0),
        tp_size=tp_size,
    )
    return receiver.required_dst_info_num * route.destinations, [encode(hello)]
