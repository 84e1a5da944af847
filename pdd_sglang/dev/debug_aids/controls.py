"""Per-request test controls: one ``pdd.debug`` action in the request's ``kv_hints``, beside the
``pdd.route`` action (:mod:`pdd_sglang.protocol.route`), never inside it.

SGLang carries every action of the envelope to the scheduler's ``Req`` and each consumer reads the
types it knows, so a server without the aids (:mod:`pdd_sglang.dev.debug_aids`) never reads this
one, and the route that serving code decodes has no test field.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import msgspec

from pdd_sglang.protocol.route import route_kv_hints

logger = logging.getLogger(__name__)

CONTROLS_ACTION_TYPE = "pdd.debug"
CONTROLS_ACTION_VERSION = "1"
# A test's keyword for a control: ``debug_`` and the control's name (pd_client's ``**route``).
KEYWORD_PREFIX = "debug_"


class DebugControls(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    # Relay with --pdd-debug-handoff-hold: hand off only once the relay holds this many tokens
    # (waiting for main out of its batch). A forced mode is the route's (handoff_mode).
    handoff_after_tokens: Optional[int] = None
    # Main with --pdd-debug-corrupt-wan-kv: damage this request's KV as it lands, as a flipped
    # bit on the WAN would.
    corrupt_wan_kv: Optional[bool] = None
    # Main with --pdd-debug-corrupt-wan-kv: damage one byte of a record of this request's packed
    # WAN copy in main's staging ring before it is decoded (the room must fail cleanly).
    corrupt_wan_frame: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.handoff_after_tokens is not None and self.handoff_after_tokens < 1:
            raise ValueError("handoff_after_tokens must be >= 1")


NO_CONTROLS = DebugControls()


def request_kv_hints(pipeline: str, **fields: Any) -> dict:
    """The ``kv_hints`` of a test request: the route a router would attach, from ``fields``, and
    the ``debug_``-prefixed ``fields`` as controls (``debug_handoff_after_tokens=7``); refuses an
    unknown or malformed field either way."""
    controls = {name[len(KEYWORD_PREFIX):]: value for name, value in fields.items()
                if name.startswith(KEYWORD_PREFIX) and value is not None}
    hints = route_kv_hints(pipeline, **{name: value for name, value in fields.items()
                                        if not name.startswith(KEYWORD_PREFIX)})
    if controls:
        payload = msgspec.to_builtins(msgspec.convert(controls, DebugControls))
        hints["actions"].append({"action_id": "pdd-debug", "action_type": CONTROLS_ACTION_TYPE,
                                 "action_version": CONTROLS_ACTION_VERSION, "payload": payload})
    return hints


def controls_of(kv_hints: Any) -> DebugControls:
    """The controls in a request's ``kv_hints`` (SGLang's ``KvHintsEnvelope``); none if absent.
    A malformed action is logged and read as none: it must not stop the scheduler."""
    for action in getattr(kv_hints, "actions", None) or ():
        if action.action_type != CONTROLS_ACTION_TYPE:
            continue
        try:
            if action.action_version != CONTROLS_ACTION_VERSION:
                raise ValueError(f"version {action.action_version!r}")
            return msgspec.convert(action.payload, DebugControls)
        except (msgspec.ValidationError, ValueError) as err:
            logger.error("PDD: ignoring a malformed %s action: %s", CONTROLS_ACTION_TYPE, err)
            return NO_CONTROLS
    return NO_CONTROLS


def controls_for(req: Any) -> DebugControls:
    """A request's controls, parsed once (the relay's aids read them every step)."""
    cached = getattr(req, "_pdd_debug_controls", None)
    if cached is None:
        cached = req._pdd_debug_controls = controls_of(getattr(req, "kv_hints", None))
    return cached
