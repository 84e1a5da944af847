"""The only module that SGLang patches call into.

Every patch in ``patches/`` adds one guarded call to a function here; the functions stay thin and
dispatch to the modules that hold the logic. Keeping the surface in one file makes the contract
with upstream readable at a glance, and ``tests/upstream`` checks both sides of it.

Inert without a role: a server started without ``--pdd-role`` (a plain SGLang server that merely
has this package installed) must pay nothing. Every hook's first line asks :func:`pdd_role`, read
once per process, and returns SGLang's own answer when it is ``None``: no PDD module is imported,
no thread started, no ledger row or lock taken, no ``/server_info`` block added.

The hooks hold no state: per-server state lives on the object SGLang hands in (the KV manager's
``pdd_fanout``/``pdd_wan_path``, the scheduler's handoff), owned and closed there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional

if TYPE_CHECKING:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import AbortNotification, CommonKVReceiver
    from sglang.srt.disaggregation.common.utils import TransferKVChunk
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.server_args import ServerArgs

_UNRESOLVED = object()
_role: object = _UNRESOLVED  # then the role: "prefill", "relay", "main" or None


def pdd_role() -> Optional[str]:
    """This process's ``--pdd-role`` (None: not a PDD server), read once from SGLang's args."""
    global _role
    if _role is _UNRESOLVED:
        try:
            from sglang.srt.runtime_context import get_server_args

            args = get_server_args()
        except Exception:  # no server args published in this process (yet): not a server
            return None
        if args is None:
            return None
        _role = getattr(args, "pdd_role", None)
    return _role  # type: ignore[return-value]


def server_arg_namespaces() -> list:
    """Extra typed argument namespaces for ``ServerArgs`` (patch 0001): the flags always exist."""
    from pdd_sglang.server_args import PddArgs

    return [PddArgs]


def resolve_server_args(server_args: ServerArgs) -> None:
    """Map ``--pdd-role`` onto the PD flags, or refuse contradictions (patch 0001)."""
    global _role
    _role = getattr(server_args, "pdd_role", None)
    if _role is None:
        return
    from pdd_sglang.server_args import resolve_pdd_server_args

    resolve_pdd_server_args(server_args)


# ---- transfer accounting (prefill): patch 0003 ----------------------------------------------
def begin_kv_transfer(room: int, destination_session: str, pages: int) -> None:
    """A prefill transfer worker starts a chunk of ``room`` to one destination."""
    if pdd_role() is None:
        return
    from pdd_sglang.prefill.ledger import LEDGER

    LEDGER.begin(room, destination_session, pages)


def begin_aux_transfer(room: int, destination_session: str) -> None:
    """A prefill sends one request's aux metadata to one destination."""
    if pdd_role() is None:
        return
    from pdd_sglang.prefill.ledger import LEDGER

    LEDGER.begin_aux(room, destination_session)


def record_kv_transfer_batch(destination_session: str, lengths: Iterable[int]) -> None:
    """Bytes handed to Mooncake in one batch."""
    if pdd_role() is None:
        return
    from pdd_sglang.prefill.ledger import LEDGER

    LEDGER.record_batch(destination_session, lengths)


# ---- /server_info: patch 0004 -----------------------------------------------------------------
def add_internal_state(scheduler: Scheduler, state: dict) -> None:
    """PDD's part of ``/server_info``."""
    if pdd_role() is None:
        return
    import pdd_sglang.decode  # noqa: F401 - each role registers its part of the state on import
    import pdd_sglang.prefill  # noqa: F401
    from pdd_sglang.decode.tp_sync import rank_pools
    from pdd_sglang.diagnostics.server_info import add_pdd_state

    add_pdd_state(scheduler, state)
    pools = rank_pools(scheduler, state["pdd"]["pool"])  # None at TP 1
    if pools is not None:  # every TP rank's pool (rank 0 answers /server_info)
        state["pdd"]["tp_ranks"] = pools


# ---- decode side (relay, main): patch 0005 ------------------------------------------------
def attach_route(receiver: CommonKVReceiver, req: Req) -> None:
    """Keep the request's PDD route (from ``kv_hints``) on its new KV receiver."""
    if pdd_role() is None:
        return
    from pdd_sglang.decode.destination import attach_route as attach

    attach(receiver, req)


def receiver_metadata(receiver: CommonKVReceiver, decode_prefix_len: Optional[int],
                      kv_indices: Any = None) -> tuple:
    """``(required_dst_info_num, extra_frames)`` for a receiver's transfer metadata; a main's
    hello may offer a staging range for coded KV of the pages ``kv_indices`` (patch 0020)."""
    if pdd_role() is None:
        return receiver.required_dst_info_num, []
    from pdd_sglang.decode.destination import receiver_metadata as metadata

    return metadata(receiver, decode_prefix_len, kv_indices)


# ---- main: coded WAN KV decoded before the room lands: patch 0020 -----------------------------
def receiver_concluding(receiver: CommonKVReceiver, status: KVPoll) -> KVPoll:
    """A receiver's poll first sees its room Success or Failed (scheduler thread): main decodes
    a coded copy into its pages first; Failed when it does not decode."""
    if pdd_role() != "main":
        return status
    from pdd_sglang.decode.destination import concluding

    return concluding(receiver, status)


# ---- prefill side: patches 0006 (the fan-out owns its rooms), 0007 (WAN path) -----------------
def start_prefill_fanout(kv_mgr: MooncakeKVManager) -> None:
    """Start the fan-out of a PDD prefill's KV manager: its owner, senders and WAN engine."""
    if pdd_role() != "prefill":
        return
    from pdd_sglang.prefill.wan_path import start_wan_path

    start_wan_path(kv_mgr)


def claim_registration(kv_mgr: MooncakeKVManager, room: int, session: str,
                       frames: list) -> bool:
    """SGLang's bootstrap thread: True when a destination's registration is a PDD room's (it
    carries a hello); the fan-out then owns it and SGLang's ``transfer_infos`` never holds it."""
    if pdd_role() != "prefill":
        return False
    return kv_mgr.pdd_fanout.claim_registration(room, session, frames)


def claim_abort(kv_mgr: MooncakeKVManager, notification: AbortNotification) -> bool:
    """SGLang's bootstrap thread: True when a decode's ABORT is for a PDD room; the fan-out acks
    it once no PDD sender still writes that decode's pages (SGLang's worker never held them)."""
    if pdd_role() != "prefill" or getattr(kv_mgr, "pdd_fanout", None) is None:
        return False
    return kv_mgr.pdd_fanout.claim_abort(notification)


def take_transfer_request(kv_mgr: MooncakeKVManager, chunk: TransferKVChunk) -> bool:
    """The scheduler's ``add_transfer_request``: True when the chunk is a PDD room's, which the
    fan-out sends to each destination (SGLang's transfer queues never see it)."""
    if pdd_role() != "prefill":
        return False
    return kv_mgr.pdd_fanout.take_chunk(chunk)


def on_sender_cleared(kv_mgr: MooncakeKVManager, room: int) -> None:
    """SGLang's prefill sender cleared ``room`` (finished, failed or aborted): PDD lets it go."""
    if pdd_role() != "prefill" or getattr(kv_mgr, "pdd_fanout", None) is None:
        return
    kv_mgr.pdd_fanout.sender_cleared(room)


def engine_for_session(kv_mgr: MooncakeKVManager, session: str):
    """The Mooncake engine for one destination: the WAN engine for a main."""
    if pdd_role() != "prefill":
        return kv_mgr.engine
    return kv_mgr.pdd_fanout.engine_for(session)


# ---- prefill and decode at different TP sizes: patch 0019 -------------------------------------
def sliced_transfer_engine(kv_mgr: MooncakeKVManager, session: str, lengths: Iterable[int]):
    """SGLang's ``send_kvcache_slice`` is about to write one layer's head slices to ``session``:
    charge them to the ledger and name the engine, as ``_transfer_data`` does for whole pages."""
    if pdd_role() != "prefill":
        return kv_mgr.engine
    record_kv_transfer_batch(session, lengths)
    return engine_for_session(kv_mgr, session)


# ---- debug (patches/debug/0001, applied only with --with-debug) ---------------------------------
def on_prompt_kv_complete(scheduler: Scheduler, req: Req) -> None:
    """A server holds a request's whole prompt KV (prefill: last chunk; decode: transfer done)."""
    if pdd_role() is None:
        return
    from pdd_sglang.diagnostics import kv_digest

    kv_digest.record(scheduler, req)


# ---- the handoff (relay, main): patch 0009 ---------------------------------------------------
def handoff_hold(scheduler: Scheduler, transferred_reqs: list[Req]) -> list[Req]:
    """Requests whose KV has landed: main keeps P->RLD->MD ones for the handoff."""
    if pdd_role() is None:
        return transferred_reqs
    from pdd_sglang.decode import handoff_for

    handoff = handoff_for(scheduler)
    return transferred_reqs if handoff is None else handoff.hold(transferred_reqs)


def handoff_step(scheduler: Scheduler, running_batch: ScheduleBatch) -> tuple:
    """Between two decode steps: ``(running_batch, a handoff EXTEND batch to run now or None)``."""
    if pdd_role() is None:
        return running_batch, None
    from pdd_sglang.decode import handoff_for

    handoff = handoff_for(scheduler)
    return (running_batch, None) if handoff is None else handoff.step(running_batch)


def handoff_idle(scheduler: Scheduler) -> bool:
    """False while a handoff holds requests outside SGLang's own queues."""
    if pdd_role() is None:
        return True
    from pdd_sglang.decode import handoff_for

    handoff = handoff_for(scheduler)
    return handoff is None or handoff.idle()


def handoff_abort(scheduler: Scheduler, abort_req: AbortReq) -> None:
    """SGLang's /abort_request: also drop matching requests the handoff holds outside its queues."""
    if pdd_role() is None:
        return
    from pdd_sglang.decode import handoff_for

    handoff = handoff_for(scheduler)
    if handoff is not None:
        handoff.abort(abort_req)


# ---- shutdown: patch 0010 -----------------------------------------------------------------------
def on_scheduler_exit(scheduler: Scheduler) -> None:
    """The scheduler leaves its event loop: close every PDD owner in this process."""
    if pdd_role() is None:
        return
    from pdd_sglang.lifecycle import close_scheduler

    close_scheduler(scheduler)


# ---- a group SIGTERM reaches the launcher only: patch 0012 -------------------------------------
def before_children_start() -> None:
    """The launcher is about to start its scheduler and detokenizer (lifecycle, module docstring)."""
    if pdd_role() is None:
        return
    from pdd_sglang.lifecycle import ignore_sigterm_in_children

    ignore_sigterm_in_children()


def after_children_started() -> None:
    """The launcher's scheduler and detokenizer run: SIGTERM is the launcher's own again."""
    if pdd_role() is None:
        return
    from pdd_sglang.lifecycle import restore_sigterm

    restore_sigterm()


# ---- the router's compact WAN-line poll: patch 0018 ----------------------------------------
def add_http_routes(app) -> None:
    """The launcher's HTTP server is about to start: a PDD prefill serves ``GET /pdd/line``,
    ``POST /pdd/cache_only``, ``POST /pdd/relay_lost`` and ``POST /pdd/chat_request``."""
    if pdd_role() != "prefill":
        return
    from pdd_sglang.diagnostics import line_report
    from pdd_sglang.prefill import cache_only, chat_request

    line_report.add_route(app)
    cache_only.add_route(app)
    chat_request.add_route(app)


# ---- waiting without spinning: patch 0011 ---------------------------------------------------
def wait_while_stalled(scheduler: Scheduler) -> None:
    """No batch to run, but work in flight (transfers, bootstraps, a handoff): wait, don't spin."""
    if pdd_role() is None:
        return
    from pdd_sglang.stall import stall_wait_for

    stall_wait_for(scheduler, pdd_role()).wait()
