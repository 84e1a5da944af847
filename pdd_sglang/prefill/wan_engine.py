"""The prefill's second Mooncake engine: the WAN path to main, configured apart from the relay's.

SGLang runs one shared Mooncake engine per process, whose transport comes from
``MOONCAKE_PROTOCOL``/``--disaggregation-transfer-backend``; on a PDD prefill that engine serves
the relay, next door (RDMA in production). The main sits across a WAN line that RDMA cannot cross,
so the prefill opens a second engine with the WAN's own protocol and device
(``--pdd-wan-transfer-protocol``, ``--pdd-wan-ib-device``) and host (``--pdd-wan-hostname``, so
WAN traffic can leave by its own NIC; default ``--pdd-advertise-host``), registers the same KV
memory with it, and sends every batch for a main session through it. Mooncake does the transport
on both paths.

**A copy keeps a window of bytes in flight.** A copy to main goes out as slices of
``slice_bytes`` (one ``batch_transfer_sync`` call of SGLang's ``send_kvcache`` each,
``prefill/senders.py``). Inside
:meth:`WanTransferEngine.copy` a slice is submitted and the call returns at once, as long as the
copy's bytes in flight plus the slice fit in ``window_bytes``; otherwise it first waits for the
oldest blocks to land. The copy's end (:meth:`WanCopy.finish`) waits for every block, so the
sender writes the aux data (main's word that the KV is complete) only after the KV has landed.
A window of one 4 MiB slice is the rule before this one (:data:`ONE_SLICE`): each slice waited
for before the next, one slice per round trip, which fills a line only while its
bandwidth-delay product is below a slice (``scripts/bench_wan_line.py`` runs both). Slices and
window come from the line the operator declares (``--pdd-wan-bandwidth-gbps`` x
``--pdd-wan-rtt-ms``, see :func:`window_for_line`), so cancelling a copy, or a copy a request
waits for overtaking one that only warms main's cache, shares the line with at most one window
(the yielding copy hands the line over at once and lands its window beside the new copy:
``WanLines.hand_over``): sixteen round trips of the line, whatever its rate. A *background* copy, one no request waits on for a token
(cache-only: the relay answered alone; or relay-covered: a relay answers the request while the
copy flies), keeps a smaller window, at most a tenth of a second of the declared line
(:func:`background_window`, :data:`pdd_sglang.policy.wan_order.BACKGROUND_IN_FLIGHT_S`): the copy
of a request with no token yet shares the line with that much at most of one, for a background copy
that fills less of a slow line (0.71 against 0.87 at 10 Mbit/s x 40 ms).

Waiting: Mooncake's synchronous batch call polls without sleeping, a core per waiting worker.
This engine submits each block asynchronously (``transfer_submit_write``, one single-task batch
per block, the only status Mooncake can report without blocking) and polls with an exponential
back-off sleep. The back-off never idles the line: with a window of many round trips, the blocks
still in flight keep it busy while the oldest is polled. The transfer timeout
(``--pdd-wan-transfer-timeout``) applies to every block, from its submission. The relays' path,
SGLang's own engine, is waited on the same way (:func:`polled_local_engine`, its timeout
Mooncake's ``MC_TRANSFER_TIMEOUT``): a relay's copy spinning in Mooncake's synchronous call took
0.2-0.8 CPU-seconds of the prefill's 0.5-core quota in each of the demo's PDD setups, which its
forward then lacked (docs/measurements.md).

Threads: a :class:`WanCopy` belongs to the sender thread that opened it (it is bound to that
thread, and only that thread's ``batch_transfer_sync`` calls join it); a call from any other
thread (SGLang's per-layer executor with a custom memory pool, the aux write outside a copy) is a
copy of its own, waited for before it returns. ``_abandoned`` is shared and locked.

Memory Mooncake may still read: a block given up on (past twice the timeout, or at shutdown) is
*abandoned*: Mooncake still owns it and may still read its source. A block may carry a release
(a packed record's place in the prefill's send pool, :mod:`pdd_sglang.prefill.send_pool`): it
runs when the block has ended, for an abandoned one only once Mooncake says so (the reaper), so
no later copy writes over bytes a stalled request still reads. At shutdown :meth:`close`
unregisters the engine's memory only once every abandoned block has ended (waiting up to
:data:`CLOSE_DRAIN_S`); one still running keeps the memory registered and the engine alive.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from pdd_sglang.policy.wan_order import BACKGROUND_IN_FLIGHT_S, background_in_flight_bytes
from pdd_sglang.prefill.wan_line import WanLine

logger = logging.getLogger(__name__)

# Mooncake's transfer_check_status: 1 done, 0 in progress, -1 failed, -2 timed out.
_DONE, _PENDING, _FAILED, _TIMED_OUT = 1, 0, -1, -2
# Back-off between status polls of a waiting block: from a fast line's latency up to a period
# that is noise beside a multi-second WAN copy (and, with a window of many round trips, never
# leaves the line idle).
FIRST_POLL_S = 0.0005
LONGEST_POLL_S = 0.02
# The submission unit of a copy to main (one SGLang send_kvcache call), sized to the line:
# SLICE_BDPS bandwidth-delay products, within these bounds; and a copy keeps WINDOW_BDPS of them
# in flight plus the slice being admitted. Why so many: Mooncake's TCP transport runs one request
# per lane and completes it on the receiver's acknowledgement, so each request (a slice's block:
# its pages of one layer, K or V) leaves its lane idle for a round trip once its last byte is
# out, and a BBR flow does not hand that lane's share to the others within the round trip. A
# copy with W bytes in flight (at most lanes x block) then moves about W / (W + BDP) of the
# line. Measured at 200 Mbit/s x 100 ms (BDP 2.5 MB), one 96 MB copy of 8 blocks per slice:
# slices of 2 BDPs with 4 in flight 0.44-0.70 of the line, slices of 4 BDPs with 8 in flight
# 0.88, 12 0.89, 16 0.91; at 400 Mbit/s x 200 ms, slices of 4 with 8 in flight 0.97
# (docs/measurements.md). A cancel, or a copy a request waits for overtaking one that only warms
# main's cache, waits for what is in flight: at most WINDOW_BDPS + SLICE_BDPS round trips of the
# line (0.32 s at the brief's 20 ms). Small slices on slow lines keep that short.
SLICE_BDPS = 4.0
MIN_SLICE_BYTES = 256 << 10
MAX_SLICE_BYTES = 64 << 20
# The smallest Mooncake request (block) that keeps the line full: with 16 lanes of half a BDP,
# eight BDPs are on the wire. A slice's blocks are its pages of one KV buffer (a layer's K or V)
# when it goes one-sided into main's pages, so the model's layer count divides the slice: at
# 200 Mbit/s x 100 ms, slices of 4 BDPs with 12 more in flight, one copy of 20 BDPs moved 0.83-0.88
# of the line in 8 blocks per slice (a 4-layer model's), 0.65 in 64 (32 layers) and 0.34 in 160
# (80 layers) (docs/measurements.md). So a raw copy goes as records of this size packed into
# main's staging ring instead (prefill/wan_coded.py; on RDMA only below this size,
# policy.wan_codec.stage_raw).
BLOCK_BDPS = 0.5
MIN_BLOCK_BYTES = 4 << 10  # a slow line's slices are clamped up, so its blocks exceed this anyway
MAX_BLOCK_BYTES = 32 << 20
BLOCKS_PER_EXPLICIT_SLICE = 8
# The rule before windowed copies, still the sender's with --pdd-wan-window-mb 4: one 4 MiB
# slice at a time, each waited for before the next.
WAN_SLICE_BYTES = 4 << 20
WINDOW_BDPS = 12.0
# Mooncake's TCP transport by default opens a connection per request (a handshake and a slow
# start each time). Pooled, it keeps lanes open per peer and runs one request per lane at a time:
# its most lanes (16). Measured across the emulated line at 200 Mbit/s x 100 ms with a 32 MiB
# window, one copy: 94 Mbit/s unpooled, 95 with the default 4 lanes, 170 with 16
# (docs/measurements.md). Set before the WAN engine initialises (Mooncake reads them then); an
# operator's own values win.
TCP_TRANSPORT_ENV = {"MC_TCP_ENABLE_CONNECTION_POOL": "1", "MC_TCP_LANES_PER_PEER": "16"}
# The prefill's WAN sender threads (prefill/wan_path.py): at most one per main's line at a time.
WAN_SENDERS = 4
# Shutdown: how long close() waits for Mooncake to end the blocks copies gave up on before it
# unregisters the memory they read (the copies give up within LONGEST_POLL_S of stop_waiting).
CLOSE_DRAIN_S = 2.0
# Engines closed with blocks Mooncake still runs: their memory stays registered and referenced
# for the life of the process, never freed under a request that reads it.
_KEPT: list = []


@dataclass(frozen=True)
class CopyWindow:
    """How a copy goes out: slices of ``slice_bytes``, at most ``window_bytes`` in flight, in
    Mooncake requests of at least ``block_bytes`` each where the copy can choose (packed)."""

    slice_bytes: int
    window_bytes: int
    block_bytes: int = WAN_SLICE_BYTES // BLOCKS_PER_EXPLICIT_SLICE


ONE_SLICE = CopyWindow(WAN_SLICE_BYTES, WAN_SLICE_BYTES)


def window_for_line(bandwidth_gbps: float, rtt_ms: float, window_mb: float = 0.0) -> CopyWindow:
    """A copy's slices and window: with ``--pdd-wan-window-mb``, that window and slices of at
    most 4 MiB (4: the old rule); else slices sized by the bandwidth-delay product of the
    declared line (SLICE_BDPS of them) and WINDOW_BDPS in flight plus the slice being admitted."""
    if window_mb < 0 or bandwidth_gbps <= 0 or rtt_ms <= 0:
        raise ValueError(
            f"the WAN line needs a positive bandwidth and RTT and a window >= 0 (got "
            f"{bandwidth_gbps} Gbit/s, {rtt_ms} ms, window {window_mb} MB)")
    if window_mb > 0:
        window = max(int(window_mb * (1 << 20)), 1)
        slice_bytes = min(WAN_SLICE_BYTES, window)
        return CopyWindow(slice_bytes, window,
                          max(slice_bytes // BLOCKS_PER_EXPLICIT_SLICE, 1))
    bdp_bytes = bandwidth_gbps * 1e9 / 8 * rtt_ms / 1e3
    slice_bytes = int(min(max(SLICE_BDPS * bdp_bytes, MIN_SLICE_BYTES), MAX_SLICE_BYTES))
    block_bytes = int(min(max(BLOCK_BDPS * bdp_bytes, MIN_BLOCK_BYTES), MAX_BLOCK_BYTES,
                          slice_bytes))
    return CopyWindow(slice_bytes, int(WINDOW_BDPS * bdp_bytes) + slice_bytes, block_bytes)


def background_window(window: CopyWindow, line_bytes_per_s: float,
                      in_flight_s: float = BACKGROUND_IN_FLIGHT_S) -> CopyWindow:
    """The window of a background copy (no request waits on it for a token): at most the
    policy's bound in flight, its
    slice included (:func:`pdd_sglang.policy.wan_order.background_in_flight_bytes`), in slices
    of a third of it, so a needed-now copy that takes the line from it waits that long at most;
    ``window`` itself where it is smaller."""
    bound = int(background_in_flight_bytes(line_bytes_per_s, in_flight_s))
    if window.window_bytes <= bound:
        return window
    slice_bytes = max(min(window.slice_bytes, bound // 3), MIN_BLOCK_BYTES)
    return CopyWindow(slice_bytes, max(bound, slice_bytes), min(window.block_bytes, slice_bytes))


@dataclass
class _Block:
    batch: int
    nbytes: int
    submitted_at: float  # the line's accounting mark and the block's timeout start
    release: Optional[Callable[[bool], None]] = None  # runs once Mooncake ended it (landed?)


class WanTransferEngine:
    """A Mooncake TransferEngine with the call surface SGLang's transfer code uses."""

    def __init__(self, hostname: str, protocol: str, device: Optional[str], timeout_s: float,
                 line: Optional[WanLine] = None, window: CopyWindow = ONE_SLICE):
        from mooncake.engine import TransferEngine

        if protocol == "tcp":
            for name, value in TCP_TRANSPORT_ENV.items():
                os.environ.setdefault(name, value)  # read as the engine initialises
        engine = TransferEngine()
        ret = engine.initialize(hostname, "P2PHANDSHAKE", protocol, device or "")
        if ret != 0:
            raise RuntimeError(
                f"PDD: the WAN Mooncake engine failed to initialise (protocol {protocol!r}, "
                f"device {device!r}, host {hostname!r})"
            )
        self._setup(engine, timeout_s, line, window)
        self.protocol = protocol
        self.session_id = f"{hostname}:{engine.get_rpc_port()}"

    @classmethod
    def over(cls, engine: Any, timeout_s: float, line: Optional[WanLine] = None,
             window_bytes: int = WAN_SLICE_BYTES,
             slice_bytes: int = WAN_SLICE_BYTES,
             block_bytes: Optional[int] = None) -> "WanTransferEngine":
        """This engine's logic over an engine already made: SGLang's own Mooncake engine
        (:func:`polled_local_engine`, the relay path, which names its protocol and session), or a
        scripted one in unit tests."""
        self = cls.__new__(cls)
        self._setup(engine, timeout_s, line, CopyWindow(
            slice_bytes, window_bytes,
            block_bytes or max(slice_bytes // BLOCKS_PER_EXPLICIT_SLICE, 1)))
        self.protocol, self.session_id = "scripted", "scripted"
        return self

    def _setup(self, engine: Any, timeout_s: float, line: Optional[WanLine],
               window: CopyWindow) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the WAN transfer timeout must be positive, got {timeout_s}")
        if not (window.window_bytes > 0 and window.slice_bytes > 0 and window.block_bytes > 0):
            raise ValueError(f"the WAN window and slice must be positive, got {window}")
        self.engine = engine
        self.timeout_s = float(timeout_s)
        self.window_bytes = int(window.window_bytes)  # read by the senders at each slice
        self.slice_bytes = int(window.slice_bytes)
        self.block_bytes = int(window.block_bytes)
        # A background copy's window (background_window; None: the same as every copy's), set
        # once by open_wan_engine before a sender runs.
        self.background_window: Optional[CopyWindow] = None
        self.line = line if line is not None else WanLine()
        self._registered: list[int] = []
        self._lock = threading.Lock()
        # Blocks given up on that Mooncake still owns, (batch, release): reaped once they end.
        self._abandoned: list[tuple[int, Optional[Callable[[bool], None]]]] = []
        self._stopping = False  # set by stop_waiting: a waiting copy gives up at its next poll
        self._closed = False
        self._thread_copy = threading.local()  # .copy: the WanCopy its sender thread has open

    def window_for(self, background: bool) -> CopyWindow:
        """The window a copy goes out with now: a background one keeps less in flight
        (:func:`background_window`); the senders ask at every slice, since a copy turns
        cache-only when its relay finishes, mid-copy as often as not, and stops being
        relay-covered when its relay fails."""
        if background and self.background_window is not None:
            return self.background_window
        return CopyWindow(self.slice_bytes, self.window_bytes, self.block_bytes)

    def register_regions(self, regions: List[tuple]) -> None:
        if not regions:
            return
        ptrs, lens = zip(*regions)
        ret = self.engine.batch_register_memory(list(ptrs), list(lens))
        if ret != 0:
            raise RuntimeError(f"PDD: registering KV memory with the WAN engine failed ({ret})")
        self._registered.extend(ptrs)

    @contextlib.contextmanager
    def copy(self, session_id: str):
        """One copy to ``session_id`` on this thread: its slices go out within the window, and
        whatever is still in flight when the block exits (a cancel, an error) is waited out, so
        no block of it can land after its sender has reported."""
        copy = WanCopy(self, session_id)
        self._thread_copy.copy = copy
        try:
            yield copy
        finally:
            self._thread_copy.copy = None
            copy.drain()

    def batch_transfer_sync(self, session_id: str, buffers, peer_addresses, lengths) -> int:
        """Write the blocks to ``session_id``; 0 when all landed (or, inside this thread's
        :meth:`copy`, were handed to Mooncake within the window), -1 otherwise (as SGLang's)."""
        args = (list(buffers), list(peer_addresses), list(lengths))
        open_copy = getattr(self._thread_copy, "copy", None)
        if open_copy is not None and open_copy.session == session_id:
            return 0 if open_copy.submit(*args) else -1
        copy = WanCopy(self, session_id)
        ok = False
        try:
            ok = copy.submit(*args) and copy.finish()
        except Exception:  # SGLang's engine wrapper reports failures as -1 the same way
            logger.exception("PDD: WAN transfer to %s raised", session_id)
        finally:
            copy.drain()
        return 0 if ok else -1

    def read(self, session_id: str, local_addr: int, peer_addr: int, length: int) -> bool:
        """Read ``length`` bytes at ``peer_addr`` of ``session_id`` into registered
        ``local_addr`` (a main's staging words), waited on as a block is; False when it failed."""
        batch = self.engine.batch_transfer_async_read(session_id, [local_addr], [peer_addr],
                                                      [length])
        if batch <= 0:
            logger.error("PDD: submitting a WAN read from %s failed (%s)", session_id, batch)
            return False
        began, pause = time.monotonic(), FIRST_POLL_S
        while True:
            status = self.engine.transfer_check_status(batch)
            if status == _DONE:
                return True
            if status != _PENDING or self._stopping \
                    or time.monotonic() - began > self.timeout_s:
                if status in (_PENDING, _TIMED_OUT):
                    self._abandon([(batch, None)])
                logger.error("PDD: a WAN read from %s failed (Mooncake status %s)", session_id,
                             status)
                return False
            time.sleep(pause)
            pause = min(pause * 2, LONGEST_POLL_S)

    def probe(self, session_id: str) -> bool:
        """Whether ``session_id`` answers over this engine (Mooncake's own probe): a main taken
        out after a failed WAN copy comes back only once the WAN path itself reaches it."""
        try:
            return self.engine.send_probe(session_id) == 0
        except Exception as err:
            logger.warning("PDD: WAN probe of %s raised: %s", session_id, err)
            return False

    def _abandon(self, blocks: list) -> None:
        """Leave ``blocks`` ((batch, release) pairs) to Mooncake: reaped once they end."""
        with self._lock:
            self._abandoned.extend(blocks)

    def abandoned_batches(self) -> list[int]:
        with self._lock:
            return [batch for batch, _ in self._abandoned]

    def _reap_abandoned(self) -> bool:
        """Free abandoned batches that have ended (Mooncake's status call frees an ended one)
        and release what they read; True when none is left."""
        with self._lock:
            ended = []
            left = []
            for batch, release in self._abandoned:
                (left if self.engine.transfer_check_status(batch) == _PENDING
                 else ended).append((batch, release))
            self._abandoned = left
        for _, release in ended:
            if release is not None:
                release(False)
        return not left

    def stop_waiting(self) -> None:
        """Shutdown: copies still on the line fail at their next poll (at most LONGEST_POLL_S),
        so the workers waiting on them can be joined."""
        self._stopping = True

    def close(self) -> None:
        """Shutdown: unregister the engine's memory once Mooncake has ended every block given
        up on (up to CLOSE_DRAIN_S); with one still running, leave it registered and alive."""
        self._stopping = True
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + CLOSE_DRAIN_S
        while not self._reap_abandoned() and time.monotonic() < deadline:
            time.sleep(LONGEST_POLL_S)
        with self._lock:
            if self._abandoned:
                logger.error("PDD: closing with %d WAN block(s) Mooncake still runs; their "
                             "memory stays registered", len(self._abandoned))
                _KEPT.append(self)
                return
            if self._registered:
                self.engine.batch_unregister_memory(self._registered)
                self._registered = []


class WanCopy:
    """The blocks of one copy to one session that Mooncake holds, oldest first, at most
    ``window_bytes`` (the engine's, or what its sender sets for the slice it admits next: a
    cache-only copy's is smaller); a slice bigger than the window goes alone. Owned by the
    thread that made it."""

    def __init__(self, wan: WanTransferEngine, session: str):
        self.wan = wan
        self.session = session
        self.window_bytes = wan.window_bytes
        self.in_flight: deque[_Block] = deque()
        self.in_flight_bytes = 0
        self.failed = False

    def submit(self, buffers: list, peers: list, lengths: list,
               release: Optional[Callable[[bool], None]] = None) -> bool:
        """Hand one slice to Mooncake once it fits in the window; False if the copy failed.
        ``release`` (one block only) runs once Mooncake has ended the block, or at once if it
        could not be submitted."""
        nbytes = int(sum(lengths))
        while (not self.failed and self.in_flight
               and self.in_flight_bytes + nbytes > self.window_bytes):
            self._land_oldest()
        if self.failed:
            if release is not None:
                release(False)
            return False
        if release is not None and len(lengths) != 1:
            raise ValueError("a release belongs to a single block")
        for src, dst, length in zip(buffers, peers, lengths):
            batch = self.wan.engine.transfer_submit_write(self.session, src, dst, length)
            if batch <= 0:
                logger.error("PDD: submitting a WAN transfer to %s failed (%s)", self.session,
                             batch)
                self.wan.line.finished(self.session, length,
                                       self.wan.line.started(self.session, length), ok=False)
                if release is not None:
                    release(False)
                self._fail()
                return False
            self.in_flight.append(_Block(batch, length, self.wan.line.started(self.session,
                                                                              length), release))
            self.in_flight_bytes += length
        return True

    def window_for_next_slice(self, background: bool) -> CopyWindow:
        """The window the copy's next slice is admitted to: a background copy's is smaller
        (:func:`background_window`). Its sender asks at every slice: a copy turns cache-only
        when its relay finishes, mid-copy as often as not, and then lands what it has over the
        smaller window before its next slice goes out."""
        window = self.wan.window_for(background)
        self.window_bytes = window.window_bytes
        return window

    def land_oldest(self) -> bool:
        """Wait for the oldest block in flight (a coded copy reuses its ring place); False once
        the copy failed."""
        if self.in_flight and not self.failed:
            self._land_oldest()
        return not self.failed

    def finish(self) -> bool:
        """Wait until every block has landed; True when all did."""
        while self.in_flight and not self.failed:
            self._land_oldest()
        if not self.failed:
            self.wan._reap_abandoned()
        return not self.failed

    def _land_oldest(self) -> None:
        """Wait for the oldest block (blocks complete roughly in submission order)."""
        block = self.in_flight[0]
        pause = FIRST_POLL_S
        while True:
            status = self.wan.engine.transfer_check_status(block.batch)
            if status == _DONE:
                self._ended(True)
                return
            if status != _PENDING:
                # A failed batch is freed by Mooncake's status call; a timed-out one is not.
                self._ended(False, abandoned=status != _FAILED)
                logger.error("PDD: a WAN transfer to %s failed (Mooncake status %s)",
                             self.session, status)
                self._fail()  # its other blocks may still be writing
                return
            if self.wan._stopping:
                self._give_up()
                logger.warning("PDD: shutting down with a WAN transfer to %s in flight; "
                               "failing it", self.session)
                return
            if time.monotonic() - block.submitted_at > self.wan.timeout_s:
                logger.error("PDD: a WAN transfer to %s took over --pdd-wan-transfer-timeout "
                             "(%.0f s); failing it once its blocks have ended", self.session,
                             self.wan.timeout_s)
                self._fail()
                return
            time.sleep(pause)
            pause = min(pause * 2, LONGEST_POLL_S)

    def _ended(self, ok: bool, abandoned: bool = False) -> None:
        """The oldest block left the copy: ended (its release runs now) or ``abandoned`` to
        Mooncake (its release runs once the reaper sees it end)."""
        block = self.in_flight.popleft()
        self.in_flight_bytes -= block.nbytes
        self.wan.line.finished(self.session, block.nbytes, block.submitted_at, ok)
        if abandoned:
            self.wan._abandon([(block.batch, block.release)])
        elif block.release is not None:
            block.release(ok)

    def _fail(self) -> None:
        self.failed = True
        self.drain()

    def drain(self) -> None:
        """Wait until Mooncake has ended every block still in flight. A copy that failed or was
        cancelled is reported only then: main frees the room's pages on that word, and a block
        Mooncake still wrote would land in pages main has given to another request (a chaos soak
        caught one by its KV digest). Waits up to another timeout (the fan-out calls a chunk
        stuck only past twice the timeout plus a margin); a block still running after that is
        abandoned, with an error in the log."""
        deadline = time.monotonic() + self.wan.timeout_s
        while self.in_flight and not self.wan._stopping and time.monotonic() < deadline:
            status = self.wan.engine.transfer_check_status(self.in_flight[0].batch)
            if status == _PENDING:
                time.sleep(LONGEST_POLL_S)
            elif status in (_DONE, _FAILED):  # ended; Mooncake's status call freed it
                self._ended(status == _DONE)
            else:  # ended without being freed (Mooncake's own timeout): the reaper frees it
                self._ended(False, abandoned=True)
        if self.in_flight:
            count = len(self.in_flight)
            self._give_up()
            if not self.wan._stopping:
                logger.error("PDD: %d block(s) of a WAN transfer to %s still run past twice "
                             "--pdd-wan-transfer-timeout; main may free pages they still write",
                             count, self.session)

    def _give_up(self) -> None:
        """Leave every block in flight to Mooncake (the reaper frees them once they end)."""
        self.failed = True
        while self.in_flight:
            self._ended(False, abandoned=True)


def wan_hostname(kv_mgr: Any, wan_host: Optional[str] = None,
                 advertise_host: Optional[str] = None) -> str:
    """The WAN engine's host: --pdd-wan-hostname, else --pdd-advertise-host, else the host of
    SGLang's own engine (then both paths leave by the same interface)."""
    return (wan_host or advertise_host or getattr(kv_mgr.engine, "hostname", None)
            or kv_mgr.local_ip)


# Mooncake's own per-transfer timeout, which SGLang's engine (the relays' path) runs under:
# its MC_TRANSFER_TIMEOUT, 30 s unless the operator sets it.
MOONCAKE_TRANSFER_TIMEOUT_S = 30.0


def polled_local_engine(kv_mgr: Any) -> WanTransferEngine:
    """SGLang's own Mooncake engine, which carries the prefill's copies to its relays, waited on
    as the WAN engine waits (asynchronous submission, back-off polls) instead of in Mooncake's
    synchronous call, which polls without sleeping. Its line accounting is its own, never
    reported: a relay is no WAN line. Each call is a copy of its own (no window)."""
    timeout_s = float(os.environ.get("MC_TRANSFER_TIMEOUT") or MOONCAKE_TRANSFER_TIMEOUT_S)
    engine = WanTransferEngine.over(kv_mgr.engine.engine, timeout_s=timeout_s)
    engine.protocol, engine.session_id = "sglang", kv_mgr.engine.get_session_id()
    return engine


def open_wan_engine(kv_mgr: Any, protocol: str, device: Optional[str], timeout_s: float,
                    line: WanLine, window: CopyWindow, hostname: Optional[str] = None,
                    background: Optional[CopyWindow] = None) -> WanTransferEngine:
    hostname = hostname or wan_hostname(kv_mgr)
    engine = WanTransferEngine(hostname, protocol, device, timeout_s, line, window)
    engine.background_window = background
    engine.register_regions(kv_mgr._registerable_regions())
    shown = background or window
    logger.info(
        "PDD: WAN transfer path ready: Mooncake %s engine %s, copies in slices of %.2f MB with "
        "%.2f MB in flight, background ones %.2f MB with %.2f MB (relay path: SGLang's engine "
        "%s)", protocol, engine.session_id, window.slice_bytes / 1e6, window.window_bytes / 1e6,
        shown.slice_bytes / 1e6, shown.window_bytes / 1e6, kv_mgr.engine.get_session_id(),
    )
    return engine
