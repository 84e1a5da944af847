"""The main decode server's side of the handoff: absorb the relay's tokens in one EXTEND, go on.

Life cycle of a P->RLD->MD request on a main:

1. SGLang's decode scheduler matches the prompt against main's radix cache, and prefill sends
   only the unmatched suffix across the WAN (:mod:`pdd_sglang.prefill.fanout`).
2. When the KV has landed, :meth:`MainHandoff.hold` keeps the request out of SGLang's waiting
   queue (it holds its KV row, its slots and its tree lock) and sends ``HandoffReady(room)`` to
   the relay named in the request's route; with ``--pdd-enable-kv-digest`` it carries a digest
   of the KV main received across the WAN, and if the relay's copy disagrees
   (``HandoffRefused("kv_digest_mismatch")``) the relay answers the request and main drops its
   copy without caching it.
3. ``HandoffTokens`` arrive: positions ``start`` onward of the relay's output. Each message is
   checked (room, order, overlap with what main already has, vocabulary) before a token is
   used; a bad one is refused, counted, answered with ``HandoffRefused`` (the relay then
   finishes the request itself) and main aborts its copy cleanly.
4. :meth:`MainHandoff.step` turns the new tokens into one EXTEND batch, the path SGLang takes for
   a radix-cache hit: the prompt's KV is the prefix (already in the request's row), the handed
   tokens are the extend part. The forward fills their KV, and on the last chunk samples the
   next token from the last position. A Catch-Up chunk that is not the last samples nothing
   (it runs as a middle chunk of a chunked prefill) and is acknowledged with ``HandoffAck``.
   Before the extend, a constrained request's grammar is advanced over the tokens it absorbs
   (:mod:`pdd_sglang.decode.handoff_grammar`), so the next token is masked from the state the
   relay left; a token the grammar refuses is refused like a bad chunk (``grammar_refused``).
5. After the last chunk the request joins the running decode batch (as SGLang merges a finished
   prefill batch) and main acknowledges that chunk too: until then the relay keeps the request
   (out of its batch), and resumes it if main refuses. Its stream starts after the handed
   tokens: the client already has them from the relay. ``max_new_tokens`` and stop conditions
   see the handed tokens as output, so limits span the handoff.
6. If the relay refuses because it finished the request alone (the singular filter), main aborts
   its copy: KV row, slots and lock are released, and the prompt KV stays in the radix cache for
   the conversation's next turn. If the relay never had the request (it died, or never
   registered with prefill), aborted it (its KV transfer failed), its connection drops (ZMQ's
   disconnect or heartbeat timeout), or it does not answer within ``--pdd-handoff-timeout``,
   main decodes the request itself from the first token, as plain PD: a delay, not an error.
   The timeout measures silence, not the whole handoff: every absorbed Catch-Up chunk restarts
   it, so a long Catch-Up from a slow but healthy relay completes. A relay silent past it in the
   middle of a Catch-Up is told ``HandoffRefused("timeout")`` and answers the request itself;
   main drops its copy (its KV runs past the last sampled token).

A held request is in one :class:`Held` state at a time: ``DIGESTING`` (with the digest on,
hashing its received KV off the scheduler thread), ``AWAITING_TOKENS`` (ready sent, or a
middle chunk acknowledged; the deadline runs), ``TOKENS_QUEUED`` (a chunk appended, its extend not
yet scheduled), ``EXTENDING`` (its extend batch is running).

At ``--tp-size`` > 1 only TP rank 0 dials relays; each step's messages, clock and channel state are
rank 0's, broadcast to every rank (:mod:`pdd_sglang.decode.tp_sync`), so every rank holds, extends,
merges and gives up on the same requests at the same iteration, and only rank 0 sends.
Owner: the scheduler thread (each TP rank's own); the control loop's thread only queues messages.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from http import HTTPStatus
from typing import Any, Optional

from pdd_sglang import seam
from pdd_sglang.diagnostics import kv_digest
from pdd_sglang.protocol.control_channel import PeerState
from pdd_sglang.decode.handoff_channel import HandoffStats, main_loop
from pdd_sglang.decode.main_extend import ExtendSteps, Held, _Parked, _RunningExtend
from pdd_sglang.decode.route_cache import is_relay_main, route_for
from pdd_sglang.decode.tp_sync import FollowerLoop, RankInputs
from pdd_sglang.protocol.messages import (FINISHED_AT_RELAY, HandoffReady, HandoffRefused,
                                          HandoffTokens, MessageError, check_token_ids)

logger = logging.getLogger(__name__)


# The relay refusal that means the client already has the relay's whole answer. Any other
# (``aborted_at_relay`` included: its KV never came, or it timed out) leaves main to decode the
# request; a client that went away has the router abort main's copy directly.
RELAY_ANSWERED_ALONE = (FINISHED_AT_RELAY,)


class MainHandoff(ExtendSteps):
    def __init__(self, scheduler: Any, args: Any):
        self.scheduler = scheduler
        self.args = args
        self.ranks = RankInputs.for_scheduler()
        self.loop = main_loop(args) if self.ranks.leader else FollowerLoop()
        self._now = time.monotonic()  # at TP > 1: rank 0's clock and channel at the latest step
        self._alive = True
        self.stats = HandoffStats("main")
        self.parked: dict[int, _Parked] = {}
        self._running: Optional[_RunningExtend] = None
        self.relays_down: set[str] = set()  # connections ZMQ saw drop and not come back
        self._closed = False

    # ---- hooks -----------------------------------------------------------------------------
    def hold(self, transferred: list) -> list:
        """Keep P->RLD->MD requests whose KV has landed; pass every other request on."""
        passed = []
        now = self._clock()
        for req in transferred:
            if not is_relay_main(req) or req.finished():
                passed.append(req)
                continue
            route = route_for(req)
            if route.relay_control in self.relays_down:
                self.stats.event("relay_down_continued_alone")
                passed.append(req)  # nobody to hand anything over: decode it here, as plain PD
                continue
            if self._closed or not self._channel_alive():
                self.stats.event("control_channel_down_continued_alone")
                passed.append(req)
                continue
            room = req.bootstrap_room
            parked = self.parked[room] = _Parked(req, route.relay_control, now,
                                                 now + self.args.pdd_handoff_timeout,
                                                 own_tokens=len(req.output_ids))
            if self.args.pdd_enable_kv_digest:
                self._start_digest(parked)
            else:
                self._send_ready(parked, HandoffReady(room=room), now)
        return passed

    def _start_digest(self, parked: _Parked) -> None:
        """Hash the KV that crossed the WAN off the scheduler thread; HandoffReady waits."""
        req = parked.req
        parked.digest_start = int(req.kv.cache_protected_len)  # before it: main's own cache
        seam.aids.main_wan_kv_landed(self, req, parked.digest_start)
        parked.digest = kv_digest.PendingHashes.start(self.scheduler, req, parked.digest_start,
                                                      background=True)
        parked.state = Held.DIGESTING

    def _send_digested(self) -> None:
        """HandoffReady for each request whose WAN copy every rank has hashed (its heads)."""
        now = self._clock()
        digesting = {room: parked.digest for room, parked in self.parked.items()
                     if parked.state is Held.DIGESTING}
        for room, hashes in self.ranks.whole_kv_hashes(digesting).items():
            parked = self.parked[room]
            parked.digest = None
            self._send_ready(parked, HandoffReady(room=room,
                                                  kv_digest=kv_digest.range_digest(hashes),
                                                  kv_digest_start=parked.digest_start), now)

    def _send_ready(self, parked: _Parked, ready: HandoffReady, now: float) -> None:
        """The deadline runs from here: the relay's silence, not main's own hashing."""
        parked.state = Held.AWAITING_TOKENS
        parked.ready_at, parked.deadline = now, now + self.args.pdd_handoff_timeout
        self.loop.send(parked.relay, ready)
        self.stats.event("ready_sent")

    def step(self, running_batch: Any) -> tuple[Any, Optional[Any]]:
        """``(running_batch, extend_batch_to_run_now or None)``, between two decode steps."""
        running_batch = self._merge_finished_extend(running_batch)
        if self._closed:
            return running_batch, None
        self._send_digested()
        messages, self._now, self._alive = self.ranks.share(self.loop)
        for peer, message in messages:
            self._on_message(peer, message)
        self._expire()
        return running_batch, self._next_extend(running_batch)

    def idle(self) -> bool:
        return not self.parked and self._running is None

    def abort(self, abort_req: Any) -> None:
        for parked in list(self.parked.values()):
            if parked.state is Held.EXTENDING:
                continue  # its extend is in flight; SGLang aborts it once it is in the batch
            if abort_req.abort_all or parked.req.rid.startswith(abort_req.rid):
                self._abort(parked, "aborted by the client", notify_relay="aborted_at_main")

    def state(self) -> dict:
        held = Counter(p.state.value for p in self.parked.values())
        return {**self.stats.snapshot(self.loop), "parked": len(self.parked), "held": dict(held)}

    def close(self) -> None:
        """Server shutdown, on the scheduler thread (or once it stopped stepping); idempotent.

        Every held request is let go: its relay is told (``main_shutting_down``) and answers it
        itself, main's copy is aborted with that reason and its KV row, slots and lock freed.
        A request whose extend is running is SGLang's (its own shutdown ends it). Then the
        control loop flushes those refusals and stops."""
        if self._closed:
            return
        self._closed = True
        for parked in list(self.parked.values()):
            if parked.state is not Held.EXTENDING:
                self._abort(parked, "PDD main is shutting down",
                            notify_relay="main_shutting_down")
        self.loop.close()
        kv_digest.PendingHashes.shutdown()

    # ---- messages --------------------------------------------------------------------------
    def _on_message(self, peer: str, message: Any) -> None:
        if isinstance(message, PeerState):
            self._on_relay_connection(message)
        elif isinstance(message, HandoffTokens):
            self._on_tokens(peer, message)
        elif isinstance(message, HandoffRefused):
            parked = self.parked.get(message.room)
            if parked is None:
                self.stats.refuse("refusal_for_unknown_room")
                return
            self.stats.event(f"relay_refused_{message.reason}")
            if message.reason in RELAY_ANSWERED_ALONE:
                self._abort(parked, f"PDD relay finished the request itself ({message.reason})",
                            notify_relay=None)
            elif message.reason == "kv_digest_mismatch":
                # The relay answers the request; the damaged copy must not reach the cache.
                self._abort(parked, "PDD: the KV received across the WAN does not match the "
                                    "relay's copy", notify_relay=None, cache=False)
            else:  # the relay never had it, or lost it: decode it here
                self._continue_alone(parked)
        else:
            self.stats.refuse("unexpected_type")
            logger.warning("PDD main: unexpected %s from relay %s", type(message).__name__, peer)

    def _on_relay_connection(self, state: PeerState) -> None:
        if state.connected:
            self.relays_down.discard(state.address)
            return
        # The relay is gone (process dead, line cut past ZMQ's heartbeat timeout): its requests
        # will get no tokens. Decode them here from the first token instead of waiting for
        # --pdd-handoff-timeout.
        self.relays_down.add(state.address)
        self.stats.event("relay_lost")
        for parked in [p for p in self.parked.values() if p.relay == state.address]:
            if parked.state in (Held.DIGESTING, Held.AWAITING_TOKENS):
                self._continue_alone(parked)

    def _on_tokens(self, peer: str, message: HandoffTokens) -> None:
        parked = self.parked.get(message.room)
        if parked is None or parked.relay != peer:
            self.stats.refuse("unknown_room")
            logger.warning("PDD main: tokens for unknown or finished room %s from %s",
                           message.room, peer)
            self.loop.send(peer, HandoffRefused(room=message.room, reason="unknown_room"))
            return
        try:
            new_tokens = self._check_tokens(parked, message)
        except MessageError as err:
            self.stats.refuse(err.reason)
            logger.warning("PDD main: refused handoff chunk of room %s: %s", message.room, err)
            if err.reason == "duplicate":
                return  # a repeat of what main has: harmless, the handoff goes on
            self._abort(parked, f"PDD handoff refused: {err}", notify_relay=err.reason)
            return
        req = parked.req
        req.output_ids.extend(new_tokens)
        parked.handed = message.start + len(message.tokens)
        parked.seq = message.seq + 1
        parked.chunk_seq = message.seq
        parked.is_last = message.is_last
        parked.state = Held.TOKENS_QUEUED
        self.stats.handed_tokens += len(new_tokens)
        if message.seq == 0:
            self.stats.latency(time.monotonic() - parked.ready_at)

    def _check_tokens(self, parked: _Parked, message: HandoffTokens) -> list[int]:
        """The tokens main does not have yet, or MessageError naming what is wrong."""
        if parked.state is not Held.AWAITING_TOKENS:
            raise MessageError("out_of_order", "a chunk arrived before the last was absorbed")
        if message.seq < parked.seq:
            raise MessageError("duplicate", f"chunk {message.seq} again (expected {parked.seq})")
        if message.seq != parked.seq or message.start != parked.handed:
            raise MessageError("out_of_order", f"chunk {message.seq} at {message.start}, "
                                               f"expected {parked.seq} at {parked.handed}")
        tokens = message.tokens
        req = parked.req
        check_token_ids(tokens, int(self.scheduler.model_config.vocab_size))
        have = len(req.output_ids)
        overlap = have - message.start
        if overlap < 0:
            raise MessageError("out_of_order", f"tokens start at {message.start}, main has {have}")
        if list(req.output_ids[message.start:have]) != tokens[:overlap]:
            raise MessageError("mismatch", "the relay's tokens disagree with main's at "
                                           f"positions {message.start}..{have}")
        new_tokens = tokens[overlap:]
        if len(req.origin_input_ids) + have + len(new_tokens) <= req.kv.kv_committed_len:
            raise MessageError("out_of_range", "a chunk with no token to extend")
        limit = req.sampling_params.max_new_tokens
        if limit is not None and have + len(new_tokens) >= limit:
            # The relay finishes at max_new_tokens itself; handing that many is a protocol error.
            raise MessageError("out_of_range", f"{have + len(new_tokens)} tokens reach "
                                               f"max_new_tokens={limit}")
        return new_tokens

    def _clock(self) -> float:
        """Now: at TP > 1 rank 0's clock of the latest step, so every rank decides alike."""
        return time.monotonic() if self.ranks.size == 1 else self._now

    def _channel_alive(self) -> bool:
        return self.loop.alive if self.ranks.size == 1 else self._alive

    def _expire(self) -> None:
        now = self._clock()
        for parked in list(self.parked.values()):
            if now > parked.deadline and parked.state is Held.AWAITING_TOKENS:
                self.stats.event("timeout" if parked.chunks_absorbed == 0
                                 else "timeout_mid_catch_up")
                logger.warning("PDD main: relay %s silent for %.1f s on room %s (%d chunks "
                               "absorbed); %s", parked.relay, self.args.pdd_handoff_timeout,
                               parked.req.bootstrap_room, parked.chunks_absorbed,
                               "decoding it here" if parked.chunks_absorbed == 0
                               else "the relay answers it")
                self.loop.send(parked.relay, HandoffRefused(room=parked.req.bootstrap_room,
                                                            reason="timeout"))
                self._continue_alone(parked, "PDD relay silent past --pdd-handoff-timeout in "
                                             "the middle of a Catch-Up handoff")

    def _continue_alone(self, parked: _Parked,
                        mid_catch_up: str = "PDD relay lost in the middle of a Catch-Up "
                                            "handoff") -> None:
        """No relay will hand anything over: main decodes from the first token, as plain PD.

        Only before any chunk is absorbed: after one, the request's KV runs past its last
        sampled token, so it is aborted instead (the client gets a clear error).
        """
        if parked.chunks_absorbed > 0:
            self._abort(parked, mid_catch_up, notify_relay=None)
            return
        del self.parked[parked.req.bootstrap_room]
        # A first chunk received but not yet extended: main has no KV for it, so it is not
        # main's output yet.
        del parked.req.output_ids[parked.own_tokens:]
        self.scheduler.waiting_queue.append(parked.req)
        self.stats.event("continued_alone")

    def _abort(self, parked: _Parked, message: str, notify_relay: Optional[str],
               cache: bool = True) -> None:
        """Abort a parked request: tell the relay if asked, stream the abort, free its row,
        slots and lock."""
        req = parked.req
        room = req.bootstrap_room
        del self.parked[room]
        if notify_relay is not None:
            self.loop.send(parked.relay, HandoffRefused(room=room, reason=notify_relay))
        self._release(req, message, cache)

    def _release(self, req: Any, message: str, cache: bool) -> None:
        from sglang.srt.disaggregation.utils import prepare_abort
        from sglang.srt.mem_cache.common import release_kv_cache

        prepare_abort(req, message, status_code=HTTPStatus.SERVICE_UNAVAILABLE)
        self.scheduler.output_streamer.stream_output([req], req.return_logprob)
        # The KV that arrived (the prompt, and any absorbed chunk) is valid unless the digest
        # said otherwise: keep it cached for the conversation's next turn.
        release_kv_cache(req, self.scheduler.tree_cache, checkpoint=cache)
        self.stats.event("aborted")
