"""The relay's handoff states: what the relay holds per room between main's messages.

A room is *pending* (main's ``HandoffReady`` came, the relay has not started) or *active*, in
one :class:`Handing` state, owned by :class:`~pdd_sglang.decode.relay.RelayHandoff` on the
scheduler thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from pdd_sglang import policy
from pdd_sglang.protocol.messages import HandoffReady


@dataclass
class Pending:
    peer: bytes
    since: float
    ready: HandoffReady


class Handing(enum.Enum):
    SENDING = "sending"  # the next chunk goes out at the next step
    AWAITING_ACK = "awaiting_ack"  # a middle chunk sent; the relay keeps decoding
    AWAITING_FINAL_ACK = "awaiting_final_ack"  # the last chunk sent; out of the batch, KV kept


@dataclass
class Active:
    req: Any
    peer: bytes
    mode: policy.HandoffMode
    handed: int = 0
    seq: int = 0
    state: Handing = Handing.SENDING
    last_sent_at: float = 0.0
