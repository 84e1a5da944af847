"""The relay -> main extend-decode handoff, and the reactive singular filter.

Timeline of a P->RLD->MD request: the WAN copy lands at main; main tells the relay (one-way
WAN delay); the relay picks a mode (policy.choose_handoff_mode) and sends token ids in chunks
(policy.next_handoff_chunk); main recomputes their KV in one extend riding in its next forward
pass and emits the next token.

If the relay finishes first (policy.relay_finishes_locally), the handoff is dropped and the
relay's slot freed; the WAN copy is cancelled only for singular traffic
(policy.cancel_wan_copy, the router's rule).  Every other copy still lands and main caches the
prompt, so the conversation's next turn hits at main instead of taking the relay again.
"""

from __future__ import annotations


from .. import policy
from ..policy import HandoffChunk, HandoffMode, Pipeline
from .engine import Event

TOKEN_ID_BYTES = 15          # the brief: 100 token ids are about 1.5 KB on the wire
CONTROL_MESSAGE_BYTES = 64


class ReadyAtRelay(Event):
    __slots__ = ("protocol", "job")

    def __init__(self, protocol, job):
        self.protocol = protocol
        self.job = job

    def fire(self, sim):
        self.protocol.begin(self.job)


class ChunkAtMain(Event):
    __slots__ = ("protocol", "job", "chunk")

    def __init__(self, protocol, job, chunk):
        self.protocol = protocol
        self.job = job
        self.chunk = chunk

    def fire(self, sim):
        job, chunk = self.job, self.chunk
        job.main.extend(job, chunk.tokens, job.request.input_tokens + chunk.start,
                        lambda: self.protocol.absorbed(job, chunk))


class AckAtRelay(Event):
    __slots__ = ("protocol", "job")

    def __init__(self, protocol, job):
        self.protocol = protocol
        self.job = job

    def fire(self, sim):
        self.protocol.send_next_chunk(self.job)


class HandoffProtocol:
    def __init__(self, cluster):
        self.cluster = cluster
        self.sim = cluster.sim
        self.wan = cluster.wan
        self.cfg = cluster.cfg.policy

    def main_ready(self, job) -> None:
        """Main holds the prompt's KV. If the relay has not even started (it is backlogged),
        main serves the request directly and the relay's place is given up."""
        if not job.relay_started:
            job.relay_abandoned = True
            job.relay.withdraw(job)
            self.cluster._main_decodes_from_start(job)
            return
        self.sim.schedule(self.wan.message_delay(CONTROL_MESSAGE_BYTES), ReadyAtRelay(self, job))

    def begin(self, job) -> None:
        if job.handoff_cancelled:
            return
        job.main_ready_at_relay = True
        if job.user_done:
            job.handoff_mode = HandoffMode.ONE_SHOT   # only to align main's cache
        else:
            held = 1 + job.relay.tokens_made(job)
            job.handoff_mode = policy.choose_handoff_mode(held, job.relay.load(), self.cfg)
        self.send_next_chunk(job)

    def send_next_chunk(self, job) -> None:
        relay = job.relay
        decoding = relay.is_decoding(job)
        held = 1 + relay.tokens_made(job) if decoding else job.request.output_tokens
        chunk = policy.next_handoff_chunk(held, job.handed_tokens, job.handoff_mode, self.cfg)
        if chunk.is_last:
            if decoding:
                made = relay.stop_decoding(job)
                chunk = HandoffChunk(job.handed_tokens, 1 + made, True)
                job.relay_last_token_s = relay.last_step_end_s if made else job.first_token_s
            self.cluster.release_relay(job)
        job.handed_tokens = chunk.end
        job.handoff_rounds += 1
        delay = self.wan.message_delay(TOKEN_ID_BYTES * chunk.tokens + CONTROL_MESSAGE_BYTES)
        self.sim.schedule(delay, ChunkAtMain(self, job, chunk))

    def absorbed(self, job, chunk: HandoffChunk) -> None:
        if not chunk.is_last:
            self.sim.schedule(self.wan.message_delay(CONTROL_MESSAGE_BYTES), AckAtRelay(self, job))
            return
        main = job.main
        if job.user_done:
            self.cluster.finish_at_main(job)
            return
        token_time = self.sim.now + main.delivery_delay_s   # the extend's own next token
        job.handoff_gap_s = token_time - job.relay_last_token_s
        if job in main.traced:
            job.token_times.append(token_time)
        remaining = job.request.output_tokens - chunk.end - 1
        if remaining <= 0:
            self.cluster.finish_at_main(job)
        else:
            main.start_decoding(job, job.request.input_tokens + chunk.end + 1, remaining,
                                lambda: self.cluster.finish_at_main(job))

    def relay_finished(self, job) -> None:
        """The relay produced the request's last token."""
        cluster = self.cluster
        cluster.finish(job, "relay", self.sim.now)
        if job.pipeline is not Pipeline.PREFILL_RELAY_MAIN or cluster.cfg.setup.value == "prld_only":
            cluster.release_relay(job)
            return
        if not policy.relay_finishes_locally(True, job.main_ready_at_relay, self.cfg):
            return      # the relay keeps the KV until main is aligned (handoff still runs)
        cluster.release_relay(job)
        job.handoff_cancelled = True
        if policy.cancel_wan_copy(job.main_uncached_tokens, job.request.output_tokens, self.cfg):
            self._cancel_copy(job)
        elif job.main_ready:
            cluster.main_keeps_prompt(job)
        else:
            # The copy is still queued or in flight: cluster._main_has_kv caches the prompt
            # when it lands and frees main's reservation; it only warms main's cache now.
            cluster.copy_turns_cache_only(job)

    def _cancel_copy(self, job) -> None:
        """Singular traffic: stop main's WAN copy (the bytes not yet sent are saved)."""
        job.cancelled_wan = True
        main = job.main
        flow = job.wan_flow
        if flow is not None and flow.active:
            main.copies_in_flight.discard(flow)
            job.wan_bytes = self.wan.cancel_flow(flow)
            job.wan_flow = None
            main.release(job)
        elif flow is not None or job.main_ready:
            # Fully sent already (landing now or landed): nothing to save; main keeps the
            # prompt, on landing (cluster._main_has_kv) or here if it has landed.
            if job.main_ready:
                self.cluster.main_keeps_prompt(job)
            else:
                main.release(job)
        else:
            main.withdraw(job)
