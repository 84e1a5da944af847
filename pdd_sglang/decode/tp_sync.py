"""A relay or main at ``--tp-size`` > 1: one handoff decision, taken by every rank.

Life cycle of a handoff step on a TP > 1 decode server:

1. Every TP rank runs its own scheduler, and each builds its own ``RelayHandoff``/``MainHandoff``.
   Only TP rank 0 opens the control channel (binds ``--pdd-control-port`` on a relay, dials relays
   on a main); the other ranks get a :class:`FollowerLoop`, which receives nothing and sends
   nothing.
2. SGLang calls the handoff step at one point of every decode iteration on every rank
   (``get_next_disagg_decode_batch_to_run``, after ``ingest_requests``, whose own broadcast keeps
   the ranks in lockstep). There :meth:`RankInputs.share` broadcasts rank 0's inputs for the step
   (the control messages it received, ZMQ's connection events, its clock, whether its channel is
   alive) to every rank over the TP CPU group, as SGLang broadcasts rank 0's requests.
3. Every rank then runs the same deterministic step on the same inputs and the same batch
   (SGLang all-reduces the KV transfer polls across the TP group, so the requests that landed
   agree), so all ranks take the same request out of the batch, run the same EXTEND, finish the
   same request, at the same iteration; only rank 0's ``send`` reaches the wire.
4. At TP 1 nothing is broadcast: the step reads its own loop and clock, as before.

Owner: the scheduler thread of each rank (one per process); nothing here is shared between
threads. :func:`rank_pools` gathers each rank's KV pool figures to ``/server_info`` (rank 0's
answer), so a test can check every rank's pool and locks.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Optional


class FollowerLoop:
    """TP rank > 0's control loop: rank 0 receives and sends for the server."""

    def __init__(self):
        self.address: Optional[str] = None
        self.alive = True
        self.refusals: Counter = Counter()

    def received(self) -> list:
        return []

    def send(self, peer: Any, message: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _tp_group() -> Optional[Any]:
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        if int(parallel.tp_size or 1) == 1:
            return None
        return parallel.tp_group
    except Exception:  # no SGLang runtime published (unit tests): a single rank
        return None


class RankInputs:
    """Rank 0's inputs to one handoff step, on every rank."""

    def __init__(self, group: Any = None):
        self.group = group
        self.size = 1 if group is None else int(group.world_size)
        self.leader = group is None or int(group.rank_in_group) == 0

    @classmethod
    def for_scheduler(cls) -> "RankInputs":
        return cls(_tp_group())

    def share(self, loop: Any) -> tuple[list, float, bool]:
        """``(messages, now, channel alive)``: rank 0's, on every rank. A collective at TP > 1:
        every rank calls it at the same point of the same iteration."""
        if self.size == 1:
            return list(loop.received()), time.monotonic(), loop.alive
        from sglang.srt.utils import broadcast_pyobj

        data = [(list(loop.received()), time.monotonic(), bool(loop.alive))] if self.leader \
            else []
        group = self.group
        data = broadcast_pyobj(data, group.rank, group.cpu_group, src=group.ranks[0])
        return data[0]

    def whole_kv_hashes(self, pending: dict) -> dict:
        """``{room: token hashes of the whole prompt KV}`` for the rooms of ``pending`` (room ->
        ``kv_digest.PendingHashes``) that every rank has hashed; the others wait for a later
        step. At TP > 1 each rank hashed its own KV heads, and the ranks' parts are gathered and
        combined here, so the hashes are a TP 1 server's whatever this server's or its peer's
        TP size (issue 37). A collective at TP > 1, without a call when ``pending`` is empty:
        every rank calls it at the same point of the same step with the same rooms."""
        from pdd_sglang.diagnostics.kv_digest import combine

        parts = {room: hashes.part() if hashes.ready() else None
                 for room, hashes in pending.items()}
        if self.size == 1 or not pending:
            return {room: combine([part]) for room, part in parts.items() if part is not None}
        import torch.distributed as dist

        ranks: list = [None] * self.size
        dist.all_gather_object(ranks, parts, group=self.group.cpu_group)
        return {room: combine([rank[room] for rank in ranks]) for room in pending
                if all(rank[room] is not None for rank in ranks)}


def rank_pools(scheduler: Any, pool: dict) -> Optional[list]:
    """Every TP rank's pool figures (rank order) at TP > 1, else None. A collective: SGLang
    handles ``GetInternalStateReq`` on every rank at the same point."""
    group = _tp_group()
    if group is None:
        return None
    import torch.distributed as dist

    pools: list = [None] * int(group.world_size)
    dist.all_gather_object(pools, pool, group=group.cpu_group)
    return pools
