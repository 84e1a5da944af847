"""A request's PDD route, carried to every server in SGLang's ``kv_hints`` envelope.

SGLang passes a versioned, orchestrator-set ``kv_hints`` envelope from ``/generate`` down to the
scheduler's ``Req`` untouched, and each consumer reads only the action types it implements. The
PDD router (and tests) attach one ``pdd.route`` action naming the request's pipeline; prefill,
relay and main read it from ``req.kv_hints``. Requests without it are plain SGLang PD requests.
"""

from __future__ import annotations

import uuid
from typing import Any, Optional

import msgspec

from pdd_sglang.messages import Pipeline

ROUTE_ACTION_TYPE = "pdd.route"
ROUTE_ACTION_VERSION = "1"
KV_HINTS_PROTOCOL_VERSION = "1"


class Route(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pipeline: Pipeline

    @property
    def destinations(self) -> int:
        """How many decode servers receive this room's KV."""
        return 2 if self.pipeline == "prefill_relay_main" else 1


def route_kv_hints(pipeline: str) -> dict:
    """The ``kv_hints`` JSON a router attaches to a request for ``pipeline``."""
    route = msgspec.convert({"pipeline": pipeline}, Route)  # refuses an unknown pipeline
    return {
        "protocol_version": KV_HINTS_PROTOCOL_VERSION,
        "message_id": uuid.uuid4().hex,
        "actions": [
            {
                "action_id": "pdd-route",
                "action_type": ROUTE_ACTION_TYPE,
                "action_version": ROUTE_ACTION_VERSION,
                "payload": msgspec.to_builtins(route),
            }
        ],
    }


class RouteError(ValueError):
    pass


def route_of(kv_hints: Any) -> Optional[Route]:
    """The PDD route in a request's ``kv_hints`` (SGLang's ``KvHintsEnvelope``), if any."""
    if kv_hints is None:
        return None
    for action in getattr(kv_hints, "actions", ()):
        if action.action_type != ROUTE_ACTION_TYPE:
            continue
        if action.action_version != ROUTE_ACTION_VERSION:
            raise RouteError(
                f"pdd.route action version {action.action_version!r}; this server reads "
                f"{ROUTE_ACTION_VERSION!r}"
            )
        try:
            return msgspec.convert(action.payload, Route)
        except msgspec.ValidationError as err:
            raise RouteError(f"malformed pdd.route payload: {err}") from None
    return None
