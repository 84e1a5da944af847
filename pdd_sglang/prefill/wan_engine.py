"""The prefill's second Mooncake engine: the WAN path to main, configured apart from the relay's.

SGLang runs one shared Mooncake engine per process, whose transport comes from
``MOONCAKE_PROTOCOL``/``--disaggregation-transfer-backend``; on a PDD prefill that engine serves
the relay, next door (RDMA in production). The main sits across a WAN line that RDMA cannot cross,
so the prefill opens a second engine with the WAN's own protocol and device
(``--pdd-wan-transfer-protocol``, ``--pdd-wan-ib-device``) and host (``--pdd-wan-hostname``, so
WAN traffic can leave by its own NIC; default ``--pdd-advertise-host``), registers the same KV
memory with it, and sends every batch for a main session through it. Mooncake does the transport
on both paths.

A WAN copy takes seconds, and Mooncake's synchronous batch call (the one SGLang's engine uses)
waits for it by polling the batch status in a loop without sleeping: a core per waiting worker.
This engine submits each block asynchronously (``transfer_submit_write``, one single-task batch
per block, the only status Mooncake can report without blocking) and waits with an exponential
back-off sleep, so a worker waiting on the line costs next to nothing. The transfer timeout
(``--pdd-wan-transfer-timeout``) is enforced here, passed in where the engine is made; Mooncake's
process-wide ``MC_TRANSFER_TIMEOUT`` only governs SGLang's own (relay) engine.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, List, Optional

from pdd_sglang.prefill.wan_line import WanLine

logger = logging.getLogger(__name__)

# Mooncake's transfer_check_status: 1 done, 0 in progress, -1 failed, -2 timed out.
_DONE, _PENDING, _FAILED = 1, 0, -1
# Back-off between status polls of a waiting batch: from a fast line's latency up to a period
# that is noise beside a multi-second WAN copy.
FIRST_POLL_S = 0.0005
LONGEST_POLL_S = 0.02


class WanTransferEngine:
    """A Mooncake TransferEngine with the call surface SGLang's transfer code uses."""

    def __init__(self, hostname: str, protocol: str, device: Optional[str], timeout_s: float,
                 line: Optional[WanLine] = None, blocking_wait: bool = False):
        from mooncake.engine import TransferEngine

        if not timeout_s > 0:
            raise ValueError(f"the WAN transfer timeout must be positive, got {timeout_s}")
        self.engine = TransferEngine()
        ret = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device or "")
        if ret != 0:
            raise RuntimeError(
                f"PDD: the WAN Mooncake engine failed to initialise (protocol {protocol!r}, "
                f"device {device!r}, host {hostname!r})"
            )
        self.protocol = protocol
        self.timeout_s = float(timeout_s)
        # --pdd-debug-wan-blocking-wait: Mooncake's own (spinning) wait, for the benchmark only.
        self.blocking_wait = blocking_wait
        self.line = line if line is not None else WanLine()
        self.session_id = f"{hostname}:{self.engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._lock = threading.Lock()
        # Batches given up on (timed out) that Mooncake still owns: freed once they end.
        self._abandoned: list[int] = []
        self._stopping = False  # set by stop_waiting: a waiting copy gives up at its next poll
        self._closed = False

    def register_regions(self, regions: List[tuple]) -> None:
        if not regions:
            return
        ptrs, lens = zip(*regions)
        ret = self.engine.batch_register_memory(list(ptrs), list(lens))
        if ret != 0:
            raise RuntimeError(f"PDD: registering KV memory with the WAN engine failed ({ret})")
        self._registered.extend(ptrs)

    def batch_transfer_sync(self, session_id: str, buffers, peer_addresses, lengths) -> int:
        """Write the blocks to ``session_id``; 0 when all landed, -1 otherwise (as SGLang's)."""
        nbytes = int(sum(lengths))
        started_at = self.line.started(session_id, nbytes)
        ok = False
        try:
            ok = self._write(session_id, list(buffers), list(peer_addresses), list(lengths))
        except Exception:  # SGLang's engine wrapper reports failures as -1 the same way
            logger.exception("PDD: WAN transfer to %s raised", session_id)
        finally:
            self.line.finished(session_id, nbytes, started_at, ok)
        return 0 if ok else -1

    def _write(self, session_id: str, buffers: list, peers: list, lengths: list) -> bool:
        if self.blocking_wait:
            return self.engine.batch_transfer_sync_write(session_id, buffers, peers, lengths) == 0
        pending: list[int] = []
        for src, dst, length in zip(buffers, peers, lengths):
            batch = self.engine.transfer_submit_write(session_id, src, dst, length)
            if batch <= 0:
                logger.error("PDD: submitting a WAN transfer to %s failed (%s)", session_id, batch)
                self._drain(pending, session_id)  # the blocks submitted may still be writing
                return False
            pending.append(batch)
        deadline = time.monotonic() + self.timeout_s
        pause = FIRST_POLL_S
        # Blocks complete roughly in submission order: wait on the oldest, then the next.
        while pending:
            status = self.engine.transfer_check_status(pending[0])
            if status == _DONE:
                pending.pop(0)
                pause = FIRST_POLL_S
                continue
            if status != _PENDING:
                # A failed batch is freed by Mooncake's status call; a timed-out one is not.
                failed = pending.pop(0)
                if status != _FAILED:
                    self._abandon([failed])
                logger.error("PDD: a WAN transfer to %s failed (Mooncake status %s)",
                             session_id, status)
                self._drain(pending, session_id)  # its other blocks may still be writing
                return False
            if self._stopping:
                self._abandon(pending)
                logger.warning("PDD: shutting down with a WAN transfer to %s in flight; failing it",
                               session_id)
                return False
            if time.monotonic() > deadline:
                logger.error("PDD: a WAN transfer to %s took over --pdd-wan-transfer-timeout "
                             "(%.0f s); failing it once its blocks have ended", session_id,
                             self.timeout_s)
                self._drain(pending, session_id)
                return False
            time.sleep(pause)
            pause = min(pause * 2, LONGEST_POLL_S)
        self._reap_abandoned()
        return True

    def _drain(self, pending: list, session_id: str) -> None:
        """A timed-out copy fails its room, and main frees the room's pages on that word; a block
        Mooncake still writes would land in pages main has given to another request (a chaos
        soak caught one by its KV digest: a copy slow on a congested line, failed at the timeout,
        wrote on). So the failure is reported only once Mooncake has ended every block, waiting
        up to another timeout (the fan-out calls a chunk stuck only past twice the timeout plus
        a margin). A block still running after that is abandoned, with an error in the log."""
        deadline = time.monotonic() + self.timeout_s
        while pending and not self._stopping and time.monotonic() < deadline:
            status = self.engine.transfer_check_status(pending[0])
            if status == _PENDING:
                time.sleep(LONGEST_POLL_S)
            elif status in (_DONE, _FAILED):  # ended; Mooncake's status call freed it
                pending.pop(0)
            else:  # ended without being freed (Mooncake's own timeout): the reaper frees it
                self._abandon([pending.pop(0)])
        if pending:
            self._abandon(pending)
            logger.error("PDD: %d block(s) of a failed WAN transfer to %s still run past twice "
                         "--pdd-wan-transfer-timeout; main may free pages they still write",
                         len(pending), session_id)

    def probe(self, session_id: str) -> bool:
        """Whether ``session_id`` answers over this engine (Mooncake's own probe): a main taken
        out after a failed WAN copy comes back only once the WAN path itself reaches it."""
        try:
            return self.engine.send_probe(session_id) == 0
        except Exception as err:
            logger.warning("PDD: WAN probe of %s raised: %s", session_id, err)
            return False

    def _abandon(self, batches: list) -> None:
        with self._lock:
            self._abandoned.extend(batches)

    def _reap_abandoned(self) -> None:
        """Free abandoned batches that have ended (Mooncake's status call frees an ended one)."""
        with self._lock:
            if not self._abandoned:
                return
            self._abandoned = [
                b for b in self._abandoned if self.engine.transfer_check_status(b) == _PENDING
            ]

    def stop_waiting(self) -> None:
        """Shutdown: copies still on the line fail at their next poll (at most LONGEST_POLL_S),
        so the workers waiting on them can be joined."""
        self._stopping = True

    def close(self) -> None:
        self._stopping = True
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._registered:
                self.engine.batch_unregister_memory(self._registered)
                self._registered = []


def wan_hostname(kv_mgr: Any, wan_host: Optional[str] = None,
                 advertise_host: Optional[str] = None) -> str:
    """The WAN engine's host: --pdd-wan-hostname, else --pdd-advertise-host, else the host of
    SGLang's own engine (then both paths leave by the same interface)."""
    return (wan_host or advertise_host or getattr(kv_mgr.engine, "hostname", None)
            or kv_mgr.local_ip)


def open_wan_engine(kv_mgr: Any, protocol: str, device: Optional[str], timeout_s: float,
                    line: WanLine, blocking_wait: bool = False, hostname: Optional[str] = None
                    ) -> WanTransferEngine:
    hostname = hostname or wan_hostname(kv_mgr)
    engine = WanTransferEngine(hostname, protocol, device, timeout_s, line, blocking_wait)
    engine.register_regions(kv_mgr._registerable_regions())
    logger.info(
        "PDD: WAN transfer path ready: Mooncake %s engine %s (relay path: SGLang's engine %s)",
        protocol, engine.session_id, kv_mgr.engine.get_session_id(),
    )
    return engine
