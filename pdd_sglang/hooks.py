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
    from pdd_sglang.transfer_accounting import LEDGER

    LEDGER.begin(room, destination_session, pages)


def begin_aux_transfer(room: int, destination_session: str) -> None:
    """A prefill sends one request's aux metadata to one destination (patch 0003)."""
    from pdd_sglang.transfer_accounting import LEDGER

    LEDGER.begin_aux(room, destination_session)


def record_kv_transfer_batch(destination_session: str, lengths) -> None:
    """Bytes handed to Mooncake in one batch (patch 0003)."""
    from pdd_sglang.transfer_accounting import LEDGER

    LEDGER.record_batch(destination_session, lengths)


def add_internal_state(scheduler: Any, state: dict) -> None:
    """PDD's part of ``/server_info`` (patch 0004)."""
    from pdd_sglang.observability import add_pdd_state

    add_pdd_state(scheduler, state)
