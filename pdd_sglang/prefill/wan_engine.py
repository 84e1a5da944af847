"""The prefill's second Mooncake engine: the WAN path to main, configured apart from the relay's.

SGLang runs one shared Mooncake engine per process, whose transport comes from
``MOONCAKE_PROTOCOL``/``--disaggregation-transfer-backend``; on a PDD prefill that engine serves
the relay, next door (RDMA in production). The main sits across a WAN line that RDMA cannot cross,
so the prefill opens a second engine with the WAN's own protocol and device
(``--pdd-wan-transfer-protocol``, ``--pdd-wan-ib-device``), registers the same KV memory with it,
and sends every batch for a main session through it. Mooncake does the transport on both paths.

Mooncake reads its transfer timeout (``MC_TRANSFER_TIMEOUT``) once per process, so it cannot
differ between the two engines: a PDD prefill raises it to ``--pdd-wan-transfer-timeout`` (a
multi-second WAN copy must not time out at Mooncake's 30 s default), which is harmless for the
relay path, whose copies take milliseconds.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, List

logger = logging.getLogger(__name__)


class WanTransferEngine:
    """A Mooncake TransferEngine with the call surface SGLang's transfer code uses."""

    def __init__(self, hostname: str, protocol: str, device: str | None):
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        ret = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device or "")
        if ret != 0:
            raise RuntimeError(
                f"PDD: the WAN Mooncake engine failed to initialise (protocol {protocol!r}, "
                f"device {device!r}, host {hostname!r})"
            )
        self.protocol = protocol
        self.session_id = f"{hostname}:{self.engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._lock = threading.Lock()

    def register_regions(self, regions: List[tuple]) -> None:
        if not regions:
            return
        ptrs, lens = zip(*regions)
        ret = self.engine.batch_register_memory(list(ptrs), list(lens))
        if ret != 0:
            raise RuntimeError(f"PDD: registering KV memory with the WAN engine failed ({ret})")
        self._registered.extend(ptrs)

    def batch_transfer_sync(self, session_id: str, buffers, peer_addresses, lengths) -> int:
        try:
            return self.engine.batch_transfer_sync_write(
                session_id, list(buffers), list(peer_addresses), list(lengths)
            )
        except Exception:  # SGLang's engine wrapper reports failures as -1 the same way
            logger.exception("PDD: WAN transfer to %s raised", session_id)
            return -1

    def close(self) -> None:
        with self._lock:
            if self._registered:
                self.engine.batch_unregister_memory(self._registered)
                self._registered = []


def open_wan_engine(kv_mgr: Any, protocol: str, device: str | None) -> WanTransferEngine:
    hostname = getattr(kv_mgr.engine, "hostname", None) or kv_mgr.local_ip
    engine = WanTransferEngine(hostname, protocol, device)
    engine.register_regions(kv_mgr._registerable_regions())
    logger.info(
        "PDD: WAN transfer path ready: Mooncake %s engine %s (relay path: SGLang's engine %s)",
        protocol, engine.session_id, kv_mgr.engine.get_session_id(),
    )
    return engine
