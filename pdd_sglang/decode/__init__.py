"""The token-ID handoff from a relay decode server to a main decode server (brief: steps 2-3).

``relay.RelayHandoff`` and ``main.MainHandoff`` each run inside one decode scheduler, driven by
the hooks of ``patches/0009``; ``handoff_channel`` builds their control loop from the server
flags, and ``finish`` holds the finish reason that tells a client (the router) where the relay
stopped.

The handoff's state (``handoff``) is registered with :mod:`pdd_sglang.diagnostics.server_info`
here, on import of the package.
"""

from typing import Any, Optional

from pdd_sglang.diagnostics.server_info import OMIT, register_state

_NOT_BUILT = object()


def handoff_for(scheduler: Any) -> Optional[Any]:
    """The scheduler's handoff side (relay or main), built on first use; ``None`` elsewhere."""
    handoff = getattr(scheduler, "_pdd_handoff", _NOT_BUILT)
    if handoff is _NOT_BUILT:
        handoff = _build(scheduler)
        scheduler._pdd_handoff = handoff
    return handoff


def _build(scheduler: Any) -> Optional[Any]:
    from sglang.srt.runtime_context import get_server_args

    args = get_server_args()
    role = getattr(args, "pdd_role", None)
    if role == "relay":
        from pdd_sglang.decode.relay import RelayHandoff

        return RelayHandoff(scheduler, args)
    if role == "main":
        from pdd_sglang.decode.main import MainHandoff

        return MainHandoff(scheduler, args)
    return None


def close_handoff(scheduler: Any) -> None:
    """SGLang's shutdown path: close the scheduler's handoff side if one was built (never builds
    one). On the scheduler thread, or once it stopped stepping; safe to call twice."""
    handoff = getattr(scheduler, "_pdd_handoff", None)
    if handoff is not None and handoff is not _NOT_BUILT:
        handoff.close()


def _handoff_state(scheduler: Any, kv_mgr: Any) -> Any:
    handoff = handoff_for(scheduler)
    return OMIT if handoff is None else handoff.state()


register_state("handoff", _handoff_state)


def _staging_state(scheduler: Any, kv_mgr: Any) -> Any:
    staging = getattr(kv_mgr, "pdd_staging", None)
    return OMIT if staging is None else staging.state()


register_state("wan_staging", _staging_state)
