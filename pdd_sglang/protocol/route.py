"""A request's PDD route, carried to every server in SGLang's ``kv_hints`` envelope.

SGLang passes a versioned, orchestrator-set ``kv_hints`` envelope from ``/generate`` down to the
scheduler's ``Req`` untouched, and each consumer reads only the action types it implements. The
PDD router (and tests) attach one ``pdd.route`` action naming the request's pipeline; prefill,
relay and main read it from ``req.kv_hints``. Requests without it are plain SGLang PD requests.
The route says where a request goes (and, for a study, how its relay hands it off): per-request
test controls travel in an action of their own (``pdd_sglang.dev.debug_aids.controls``), which a
server reads only with aids installed (``pdd_sglang.seam``); without them it is one more action
type nobody here reads.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal, Optional

import msgspec

from pdd_sglang.policy import Pipeline

ROUTE_ACTION_TYPE = "pdd.route"
ROUTE_ACTION_VERSION = "1"
KV_HINTS_PROTOCOL_VERSION = "1"


class Route(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    pipeline: Pipeline
    # The relay's control-channel address (``tcp://host:port``), on P->RLD->MD: main tells the
    # relay there that it is ready, and receives the relay's token IDs.
    relay_control: Optional[str] = None
    # On P->RLD->MD: the relay hands this request off in this mode instead of choosing one from
    # its load; ``--pdd-handoff-mode`` for one request (a study that compares the modes on the
    # same prompts). The router leaves it unset.
    handoff_mode: Optional[Literal["one-shot", "catch-up"]] = None

    def __post_init__(self) -> None:
        if self.pipeline is Pipeline.PREFILL_RELAY_MAIN and not self.relay_control:
            raise ValueError("a prefill_relay_main route needs relay_control")
        if self.handoff_mode is not None and self.pipeline is not Pipeline.PREFILL_RELAY_MAIN:
            raise ValueError("handoff_mode names a relay's handoff: only on a prefill_relay_main "
                             "route")
        if self.relay_control is not None and not self.relay_control.startswith("tcp://"):
            raise ValueError(f"relay_control must be tcp://host:port, got {self.relay_control!r}")

    @property
    def destinations(self) -> int:
        """How many decode servers receive this room's KV."""
        return 2 if self.pipeline is Pipeline.PREFILL_RELAY_MAIN else 1


def route_kv_hints(pipeline, message_id: Optional[str] = None, **fields) -> dict:
    """The ``kv_hints`` JSON a router attaches to a request for ``pipeline``; its message id is
    ``message_id`` (the router's unique rid: no random draw per request), else a fresh one."""
    fields = {k: v for k, v in fields.items() if v is not None}
    # Refuses an unknown pipeline or field, and a P->RLD->MD route without the relay's address.
    route = msgspec.convert({"pipeline": pipeline, **fields}, Route)
    return {
        "protocol_version": KV_HINTS_PROTOCOL_VERSION,
        "message_id": message_id or uuid.uuid4().hex,
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
        except (msgspec.ValidationError, ValueError) as err:
            raise RouteError(f"malformed pdd.route payload: {err}") from None
    return None
