"""The only module that SGLang patches call into.

Every patch in ``patches/`` adds one guarded call to a function here; the functions stay thin and
dispatch to the modules that hold the logic. Keeping the surface in one file makes the contract
with upstream readable at a glance, and ``tests/upstream`` checks both sides of it.
"""

from __future__ import annotations

from typing import Any


def server_arg_namespaces() -> list:
    """Extra typed argument namespaces for ``ServerArgs`` (patch 0001)."""
    from pdd_sglang.server_args import PddArgs

    return [PddArgs]


def resolve_server_args(server_args: Any) -> None:
    """Map ``--pdd-role`` onto the PD flags, or refuse contradictions (patch 0001)."""
    from pdd_sglang.server_args import resolve_pdd_server_args

    resolve_pdd_server_args(server_args)


def begin_kv_transfer(room: int, destination_session: str, pages: int) -> None:
    """A prefill transfer worker starts a chunk of ``room`` to one destination (patch 0003)."""
    from pdd_sglang.prefill.ledger import LEDGER

    LEDGER.begin(room, destination_session, pages)


def begin_aux_transfer(room: int, destination_session: str) -> None:
    """A prefill sends one request's aux metadata to one destination (patch 0003)."""
    from pdd_sglang.prefill.ledger import LEDGER

    LEDGER.begin_aux(room, destination_session)


def record_kv_transfer_batch(destination_session: str, lengths) -> None:
    """Bytes handed to Mooncake in one batch (patch 0003)."""
    from pdd_sglang.prefill.ledger import LEDGER

    LEDGER.record_batch(destination_session, lengths)


def add_internal_state(scheduler: Any, state: dict) -> None:
    """PDD's part of ``/server_info`` (patch 0004)."""
    from pdd_sglang.diagnostics.server_info import add_pdd_state

    add_pdd_state(scheduler, state)


# ---- decode side (relay, main): patch 0005 ------------------------------------------------
def attach_route(receiver: Any, req: Any) -> None:
    """Keep the request's PDD route (from ``kv_hints``) on its new KV receiver."""
    from pdd_sglang.decode.destination import attach_route as attach

    attach(receiver, req)


def receiver_metadata(receiver: Any, decode_prefix_len) -> tuple:
    """``(required_dst_info_num, extra_frames)`` for a receiver's transfer metadata."""
    from pdd_sglang.decode.destination import receiver_metadata as metadata

    return metadata(receiver, decode_prefix_len)


# ---- prefill side: patch 0006 -----------------------------------------------------------
def start_prefill_fanout(kv_mgr: Any) -> None:
    """Start the WAN transfer path of a prefill KV manager."""
    from pdd_sglang.prefill.wan_path import start_wan_path

    start_wan_path(kv_mgr)


def on_destination_registered(kv_mgr: Any, room: int, session: str, frames: list) -> None:
    kv_mgr.pdd_fanout.on_destination_registered(room, session, frames)


def room_send_start(kv_mgr: Any, room: int, transfer_infos: dict) -> int:
    return kv_mgr.pdd_fanout.room_send_start(room, transfer_infos)


def destinations_on_this_path(kv_mgr: Any, kv_chunk: Any, reqs) -> list:
    return kv_mgr.pdd_fanout.destinations_on_this_path(kv_chunk, list(reqs))


def chunk_for_destination(kv_mgr: Any, room_chunk: Any, req: Any) -> Any:
    return kv_mgr.pdd_fanout.chunk_for_destination(room_chunk, req)


def is_pdd_room(kv_mgr: Any, room: int) -> bool:
    return kv_mgr.pdd_fanout.is_pdd_room(room)


def destination_sent(kv_mgr: Any, req: Any, ok: bool) -> None:
    kv_mgr.pdd_fanout.destination_sent(req, ok)


def destination_failed(kv_mgr: Any, req: Any) -> bool:
    """True when PDD takes a failed destination out of its room and the room goes on."""
    fanout = getattr(kv_mgr, "pdd_fanout", None)
    return fanout is not None and fanout.destination_failed(req)


def engine_for_session(kv_mgr: Any, session: str) -> Any:
    """The Mooncake engine for one destination: the WAN engine for a main (patch 0006)."""
    fanout = getattr(kv_mgr, "pdd_fanout", None)
    return kv_mgr.engine if fanout is None else fanout.engine_for(session)


# ---- debug: patch 0007 -------------------------------------------------------------------
def on_prompt_kv_complete(scheduler: Any, req: Any) -> None:
    """A server holds a request's whole prompt KV (prefill: last chunk; decode: transfer done)."""
    from pdd_sglang.diagnostics import kv_digest

    kv_digest.record(scheduler, req)


# ---- the handoff (relay, main): patch 0008 ---------------------------------------------------
def handoff_hold(scheduler: Any, transferred_reqs: list) -> list:
    """Requests whose KV has landed: main keeps P->RLD->MD ones for the handoff."""
    from pdd_sglang.decode import handoff_for

    handoff = handoff_for(scheduler)
    return transferred_reqs if handoff is None else handoff.hold(transferred_reqs)


def handoff_step(scheduler: Any, running_batch: Any) -> tuple:
    """Between two decode steps: ``(running_batch, a handoff EXTEND batch to run now or None)``."""
    from pdd_sglang.decode import handoff_for

    handoff = handoff_for(scheduler)
    return (running_batch, None) if handoff is None else handoff.step(running_batch)


def handoff_idle(scheduler: Any) -> bool:
    """False while a handoff holds requests outside SGLang's own queues."""
    from pdd_sglang.decode import handoff_for

    handoff = handoff_for(scheduler)
    return handoff is None or handoff.idle()


def handoff_abort(scheduler: Any, abort_req: Any) -> None:
    """SGLang's /abort_request: also drop matching requests the handoff holds outside its queues."""
    from pdd_sglang.decode import handoff_for

    handoff = handoff_for(scheduler)
    if handoff is not None:
        handoff.abort(abort_req)
