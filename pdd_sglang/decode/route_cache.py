"""A request's PDD route, parsed once per request (relay and main read it every step)."""

from __future__ import annotations

from typing import Any, Optional

from pdd_sglang.policy import Pipeline
from pdd_sglang.protocol.route import Route, RouteError, route_of


def route_for(req: Any) -> Optional[Route]:
    """A request's PDD route, parsed once (the relay reads it every step)."""
    cached = getattr(req, "_pdd_route_cache", False)
    if cached is not False:
        return cached
    try:
        route = route_of(getattr(req, "kv_hints", None))
    except RouteError:
        route = None  # refused (and the request aborted) where the receiver was created
    req._pdd_route_cache = route
    return route


def is_relay_main(req: Any) -> bool:
    """The request's route is P->RLD->MD (the only pipeline with a handoff)."""
    route = route_for(req)
    return route is not None and route.pipeline is Pipeline.PREFILL_RELAY_MAIN
