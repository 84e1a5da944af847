"""RelayHandoff.close() and MainHandoff.close() over real control loops (ZMQ on loopback), and
the handoff statistics' bounds.

The scheduler is a stand-in: what SGLang does to free a request (abort, stream, release its KV)
is recorded instead; which requests are let go, what each peer is told, and that no PDD thread
is left are the real thing.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from pdd_sglang import policy
from pdd_sglang.protocol.control_channel import ControlLoop
from pdd_sglang.protocol.messages import HandoffReady, HandoffRefused

ARGS = dict(pdd_control_keypair=None, pdd_control_relay_key=None,
            pdd_control_authorized_keys=None, host="127.0.0.1", pdd_control_port=0,
            pdd_catch_up_threshold=64, pdd_catch_up_chunk=64, pdd_relay_load_watermark=0.7,
            pdd_handoff_timeout=30.0, pdd_enable_kv_digest=False, pdd_handoff_mode="auto")


def control_threads() -> int:
    return sum(t.name == "pdd-control" for t in threading.enumerate())


def request(room: int) -> SimpleNamespace:
    return SimpleNamespace(bootstrap_room=room, rid=f"r{room}", output_ids=[5],
                           finished=lambda: False)


def refusals(loop: ControlLoop, count: int, timeout_s: float = 5.0) -> dict:
    got, deadline = {}, time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        item = loop.wait_received(0.1)
        if item is not None and isinstance(item[1], HandoffRefused):
            got[item[1].room] = item[1].reason
    return got


def test_main_close_lets_every_held_request_go_and_tells_its_relay():
    from pdd_sglang.decode.main import Held, MainHandoff, _Parked

    relay = ControlLoop(relay_bind="tcp://127.0.0.1:0")
    try:
        main = MainHandoff(SimpleNamespace(), SimpleNamespace(**ARGS))
        released = []
        main._release = lambda req, message, cache: released.append((req.bootstrap_room, message))
        now = time.monotonic()
        for room, state in [(1, Held.AWAITING_TOKENS), (2, Held.TOKENS_QUEUED),
                            (3, Held.EXTENDING)]:
            main.parked[room] = _Parked(request(room), relay.address, now, now + 30, state=state)
        main.close()
        # Told, so the relay answers them; main's copies freed, with the reason.
        assert refusals(relay, 2) == {1: "main_shutting_down", 2: "main_shutting_down"}
        assert released == [(1, "PDD main is shutting down"), (2, "PDD main is shutting down")]
        assert list(main.parked) == [3]  # its extend is running: SGLang's to end
        assert not main.loop.alive
        main.close()  # idempotent
        batch = object()
        assert main.step(batch) == (batch, None)  # hooks after close do nothing
    finally:
        relay.close()
    assert control_threads() == 0


def test_relay_close_tells_every_waiting_main_and_frees_what_it_holds_out_of_the_batch():
    from pdd_sglang.decode.relay import Handing, RelayHandoff, Active, Pending

    relay = RelayHandoff(SimpleNamespace(), SimpleNamespace(**ARGS))
    main = ControlLoop()
    try:
        main.send(relay.loop.address, HandoffReady(room=99))
        peer, _ = relay.loop.wait_received(5)
        aborted = []
        relay._abort = lambda req, message: aborted.append((req.bootstrap_room, message))
        relay.pending[10] = Pending(peer, time.monotonic(), HandoffReady(room=10))
        one_shot = policy.HandoffMode.ONE_SHOT
        relay.active[11] = Active(request(11), peer, one_shot, state=Handing.AWAITING_ACK)
        relay.active[12] = Active(request(12), peer, one_shot,
                                   state=Handing.AWAITING_FINAL_ACK)
        relay.out_of_batch[12] = relay.active[12].req  # its last chunk out: it left the batch
        relay.close()
        # Main decodes 10 itself, drops its Catch-Up copy of 11 with the reason, and 12 (out
        # of the relay's batch, waiting for main's last ack) is aborted here, its KV freed.
        assert refusals(main, 3) == {10: "relay_shutting_down", 11: "relay_shutting_down",
                                     12: "relay_shutting_down"}
        assert aborted == [(12, "PDD relay is shutting down")]
        assert relay.idle() and not relay.loop.alive
        relay.close()
    finally:
        main.close()
    assert control_threads() == 0


def test_relay_stops_waiting_for_a_catch_up_ack_that_never_comes():
    """Issue #22 race 8: main dies mid Catch-Up. Before, the relay's AWAITING_ACK had no
    deadline: the room stayed active and the relay never went idle. Now, past FINAL_ACK_WAIT_S,
    main is told (``ack_timeout``) and the relay, which kept the request in its batch, decodes on."""
    from pdd_sglang.decode import relay as relay_module
    from pdd_sglang.decode.relay import Handing, RelayHandoff, Active

    relay = RelayHandoff(SimpleNamespace(), SimpleNamespace(**ARGS))
    main = ControlLoop()
    try:
        main.send(relay.loop.address, HandoffReady(room=98))
        peer, _ = relay.loop.wait_received(5)
        sent_at = time.monotonic() - relay_module.FINAL_ACK_WAIT_S - 1
        catch_up = policy.HandoffMode.CATCH_UP
        relay.active[21] = Active(request(21), peer, catch_up, state=Handing.AWAITING_ACK,
                                   last_sent_at=sent_at)
        relay.active[22] = Active(request(22), peer, catch_up, state=Handing.AWAITING_ACK,
                                   last_sent_at=time.monotonic())
        batch = SimpleNamespace(reqs=[])
        relay._leave_batch = lambda running_batch, reqs: running_batch
        relay.step(batch)
        assert refusals(main, 1) == {21: "ack_timeout"}
        assert list(relay.active) == [22]  # still within its deadline
    finally:
        relay.close()
        main.close()
    assert control_threads() == 0


def test_an_ack_that_crossed_the_relays_refusal_is_counted_apart_not_warned_as_unexpected():
    """The relay gives a room up (here: main's Catch-Up ack is late) and tells main, while main's
    ack of that chunk is already on the line. That ack is no fault: counted as
    ``ack_after_refusal``; an ack for a room the relay never refused stays ``unexpected_ack``."""
    from pdd_sglang.decode import relay as relay_module
    from pdd_sglang.decode.relay import Handing, RelayHandoff, Active
    from pdd_sglang.protocol.messages import HandoffAck

    relay = RelayHandoff(SimpleNamespace(), SimpleNamespace(**ARGS))
    main = ControlLoop()
    try:
        main.send(relay.loop.address, HandoffReady(room=97))
        peer, _ = relay.loop.wait_received(5)
        late = time.monotonic() - relay_module.FINAL_ACK_WAIT_S - 1
        relay.active[31] = Active(request(31), peer, policy.HandoffMode.CATCH_UP,
                                   state=Handing.AWAITING_ACK, seq=1, last_sent_at=late)
        relay._leave_batch = lambda running_batch, reqs: running_batch
        relay.step(SimpleNamespace(reqs=[]))
        assert refusals(main, 1) == {31: "ack_timeout"}
        relay._on_message(peer, HandoffAck(room=31, seq=0))  # main's ack, sent before it knew
        relay._on_message(peer, HandoffAck(room=32, seq=0))  # a room this relay never had
        state = relay.stats.snapshot(relay.loop)
        assert state["events"].get("ack_after_refusal") == 1
        assert state["refused"].get("unexpected_ack") == 1
    finally:
        relay.close()
        main.close()
    assert control_threads() == 0


def test_the_debug_hold_keeps_a_catch_up_request_from_finishing_at_the_relay():
    """A CI run started servers beside a forced Catch-Up handoff at token 200 of 300: main, starved,
    absorbed chunks slower than the relay decoded, and the relay finished the request alone (main
    answered 503, the test saw no handoff). Under the test-only hold, a Catch-Up request one token
    short of its limit now leaves the batch until main acknowledges, and is resumed when the ack
    never comes; without the hold the relay decodes it to the end, as in production."""
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    from pdd_sglang.decode import relay as relay_module
    from pdd_sglang.decode.relay import Handing, RelayHandoff, Active
    from pdd_sglang.dev.debug_aids import installed
    from pdd_sglang.dev.debug_aids.aids import DebugAids
    from pdd_sglang.dev.debug_aids.controls import request_kv_hints

    hints = decode_kv_hints_envelope(request_kv_hints(
        "prefill_relay_main", relay_control="tcp://r:1", debug_handoff_after_tokens=200,
        handoff_mode="catch-up"))

    def catch_up_request(room: int, tokens: int) -> SimpleNamespace:
        req = request(room)
        req.output_ids = list(range(tokens))
        req.sampling_params = SimpleNamespace(max_new_tokens=300)
        req.kv_hints = hints
        return req

    class Batch(SimpleNamespace):
        def filter_batch(self, reqs_to_exclude):
            left.extend(reqs_to_exclude)
            self.reqs = [r for r in self.reqs if all(r is not x for x in reqs_to_exclude)]

    for hold in (False, True):
        scheduler = SimpleNamespace(waiting_queue=[])
        relay = RelayHandoff(scheduler, SimpleNamespace(**ARGS))
        main = ControlLoop()
        try:
            main.send(relay.loop.address, HandoffReady(room=97))
            peer, _ = relay.loop.wait_received(5)
            catch_up = policy.HandoffMode.CATCH_UP
            short, last_token = catch_up_request(31, 250), catch_up_request(32, 299)
            for req in (short, last_token):
                relay.active[req.bootstrap_room] = Active(
                    req, peer, catch_up, state=Handing.AWAITING_ACK, last_sent_at=time.monotonic())
            left = []
            with installed(DebugAids(handoff_hold=hold)):
                batch, _ = relay.step(Batch(reqs=[short, last_token]))
                assert left == ([last_token] if hold else []), hold
                assert batch.reqs == ([short] if hold else [short, last_token])
                assert list(relay.out_of_batch) == ([32] if hold else [])
                assert relay.idle() is False
                if hold:  # no ack past the deadline: main is told, the relay decodes it on
                    relay.active[32].last_sent_at -= relay_module.FINAL_ACK_WAIT_S + 1
                    relay.step(Batch(reqs=[short]))
                    assert refusals(main, 1) == {32: "ack_timeout"}
                    assert scheduler.waiting_queue == [last_token] and not relay.out_of_batch
        finally:
            relay.close()
            main.close()
    assert control_threads() == 0


def test_the_debug_hold_keeps_mains_request_from_the_relays_step_until_the_handoff_point():
    """The hold wraps the relay's step (the seam's one relay point): main's request for a room
    short of its point stays out of the step, so the relay does not answer it, and is back in
    ``relay.pending`` after it; at the point the relay hands it off, in the mode its route names.
    Without the hold, the relay answers at once and chooses the mode itself."""
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    from pdd_sglang.decode.relay import RelayHandoff, Pending
    from pdd_sglang.dev.debug_aids import installed
    from pdd_sglang.dev.debug_aids.aids import DebugAids
    from pdd_sglang.dev.debug_aids.controls import request_kv_hints

    def routed(room: int, tokens: int, **fields) -> SimpleNamespace:
        req = request(room)
        req.output_ids = list(range(tokens))
        req.sampling_params = SimpleNamespace(max_new_tokens=40)
        req.kv_hints = decode_kv_hints_envelope(request_kv_hints(
            "prefill_relay_main", relay_control="tcp://r:1", **fields))
        return req

    for hold in (False, True):
        relay = RelayHandoff(SimpleNamespace(waiting_queue=[]), SimpleNamespace(**ARGS))
        started = []
        relay._start = lambda room, req, peer: started.append((room, relay._choose_mode(req)))
        relay._load = lambda: policy.RelayLoad(running_requests=1, max_running_requests=8,
                                               kv_used_tokens=10, kv_capacity_tokens=1000)
        relay._leave_batch = lambda running_batch, reqs: running_batch
        try:
            short = routed(41, 3, debug_handoff_after_tokens=8, handoff_mode="catch-up")
            chosen = routed(42, 3)  # no point, no mode: the relay's own choice (one-shot, 3 held)
            for req in (short, chosen):
                ready = HandoffReady(room=req.bootstrap_room)
                relay.pending[req.bootstrap_room] = Pending(b"main", time.monotonic(), ready)
            with installed(DebugAids(handoff_hold=hold)):
                relay.step(SimpleNamespace(reqs=[short, chosen]))
                if hold:
                    assert started == [(42, policy.HandoffMode.ONE_SHOT)]
                    assert list(relay.pending) == [41]  # put back: main's request waits
                    short.output_ids = list(range(8))
                    relay.step(SimpleNamespace(reqs=[short]))
                assert sorted(started) == [(41, policy.HandoffMode.CATCH_UP),
                                           (42, policy.HandoffMode.ONE_SHOT)], hold
                assert not relay.pending
        finally:
            relay.close()
    assert control_threads() == 0


def test_handoff_statistics_keep_the_latest_samples_in_order():
    from pdd_sglang.decode.handoff_channel import LATENCY_SAMPLES_KEPT, HandoffStats

    stats = HandoffStats("main")
    for index in range(LATENCY_SAMPLES_KEPT + 100):
        stats.latency(index / 1000)
        stats.duration(index / 100)
    snapshot = stats.snapshot(SimpleNamespace(address=None, refusals={}))
    latencies = snapshot["handoff_latency_ms"]
    assert len(latencies) == LATENCY_SAMPLES_KEPT  # bounded
    assert latencies == [float(i) for i in range(100, LATENCY_SAMPLES_KEPT + 100)]  # the latest
    assert snapshot["handoff_duration_ms"][-1] == (LATENCY_SAMPLES_KEPT + 99) * 10.0


def test_close_handoff_closes_only_what_was_built():
    from pdd_sglang.decode import close_handoff

    closed = []
    close_handoff(SimpleNamespace())  # no handoff built: nothing to do, nothing built
    close_handoff(SimpleNamespace(_pdd_handoff=None))  # a server without a relay/main role
    close_handoff(SimpleNamespace(_pdd_handoff=SimpleNamespace(close=lambda: closed.append(1))))
    assert closed == [1]


def test_an_extend_batch_takes_at_most_one_middle_catch_up_chunk():
    """SGLang keeps only one middle-chunk request a batch from streaming (its skip_stream_req):
    a second one streamed the relay's handed tokens from position 0, and the router refused the
    splice ("servers disagree on positions 42..170"), once a PDD setup in every demo run."""
    from pdd_sglang.decode.main_extend import extend_candidates

    middle = [SimpleNamespace(name=f"middle{i}", is_last=False) for i in range(3)]
    last = [SimpleNamespace(name=f"last{i}", is_last=True) for i in range(3)]
    ready = [middle[0], last[0], middle[1], last[1], middle[2], last[2]]
    assert [p.name for p in extend_candidates(ready, room_for=2)] == [
        "middle0", "last0", "last1"]
    assert [p.name for p in extend_candidates(ready, room_for=0)] == ["middle0"]
    assert [p.name for p in extend_candidates(middle[1:], room_for=5)] == ["middle1"]
