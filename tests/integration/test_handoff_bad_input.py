"""Bad handoff input against real servers: a scripted fake relay drives the real main, and a raw
ZMQ peer pokes the real relay. Every defect is refused, counted, and the request is still
completed or cleanly aborted, with nothing held afterwards."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import msgspec
import pytest
import zmq

from pdd_sglang.protocol.messages import (FINISHED_AT_RELAY, MAX_MESSAGE_BYTES, Envelope,
                                          HandoffAck, HandoffReady, HandoffRefused, HandoffTokens,
                                          decode, encode, pack_tokens)
from pdd_sglang.dev.testing.pd_client import generate_fanout, generate_pdd, relay_control_address
from pdd_sglang.dev.testing.conversation import FIRST_WORD_ID, WORDS

VOCAB = 1000 + FIRST_WORD_ID


def words(seed: int, count: int) -> list[int]:
    return [FIRST_WORD_ID + (seed * 131 + i * 7) % WORDS for i in range(count)]


# Message checks do not depend on the page size: the page-1 cluster only.
page1 = pytest.mark.parametrize("three_roles", [1], indirect=True, ids=["page1"])


@pytest.fixture
def cluster(three_roles):
    before = {n: three_roles[n].wait_idle() for n in ("prefill", "main")}
    yield three_roles
    for name, pool in before.items():
        after = three_roles[name].wait_idle()
        assert after["in_use_tokens"] == 0 and after["locked_tokens"] == 0, (name, after)
        assert after["free_request_slots"] == pool["free_request_slots"]
    assert three_roles["main"].pdd_state()["handoff"]["parked"] == 0


class FakeRelay:
    """A ROUTER socket standing where a relay's control channel would be."""

    def __init__(self):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.peer = None

    def receive(self, timeout_s: float = 60.0):
        assert self.socket.poll(int(timeout_s * 1000)), "main said nothing"
        self.peer, data = self.socket.recv_multipart()
        return decode(data)

    def send_raw(self, data: bytes) -> None:
        self.socket.send_multipart([self.peer, data])

    def send(self, message) -> None:
        self.send_raw(encode(message))

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def start_request(cluster, relay_address: str, body: dict) -> tuple[threading.Thread, dict]:
    """A P->RLD->MD request whose relay is the fake: prefill gives up on the relay after 2 s,
    sends main its KV, and main then says HandoffReady to the fake."""
    result: dict = {}

    def call():
        try:
            result.update(generate_fanout(cluster["prefill"], [cluster["main"]], body,
                                          cluster.bootstrap_port, "prefill_relay_main",
                                          route={"relay_control": relay_address}))
        except Exception as err:
            result["error"] = err

    thread = threading.Thread(target=call)
    thread.start()
    return thread, result


def refused(cluster) -> dict:
    return cluster["main"].pdd_state()["handoff"]["refused"]


@page1
@pytest.mark.parametrize("bad", ["token_out_of_vocab", "out_of_order", "mismatch"])
def test_main_refuses_a_bad_chunk_and_aborts_cleanly(cluster, bad):
    fake = FakeRelay()
    try:
        before = refused(cluster).get(bad, 0)
        body = {"input_ids": words(40, 80), "sampling_params": {"max_new_tokens": 20,
                                                                 "temperature": 0.0}}
        first_token = cluster["plain"].post_json("/generate", body)["output_ids"][0]
        thread, result = start_request(cluster, fake.address, body)
        ready = fake.receive()
        assert isinstance(ready, HandoffReady)
        other_word = FIRST_WORD_ID + (first_token - FIRST_WORD_ID + 1) % WORDS
        chunk = {
            "token_out_of_vocab": HandoffTokens(room=ready.room, seq=0, start=0,
                                                token_ids=pack_tokens([VOCAB + 7]), is_last=True),
            "out_of_order": HandoffTokens(room=ready.room, seq=1, start=5,
                                          token_ids=pack_tokens([5, 6]), is_last=True),
            # Position 0 is the token prefill sampled; a relay that disagrees is refused.
            "mismatch": HandoffTokens(room=ready.room, seq=0, start=0,
                                      token_ids=pack_tokens([other_word, 5]), is_last=True),
        }[bad]
        fake.send(chunk)
        answer = fake.receive()
        assert answer == HandoffRefused(room=ready.room, reason=bad)
        thread.join(120)
        # The client of main gets a clear error, not a hang; the request is gone everywhere.
        assert "error" in result, result
        assert refused(cluster).get(bad, 0) == before + 1
    finally:
        fake.close()


@page1
def test_main_survives_garbage_duplicates_and_unknown_rooms_then_completes(cluster):
    fake = FakeRelay()
    try:
        before = dict(refused(cluster))
        body = {"input_ids": words(41, 80), "sampling_params": {"max_new_tokens": 30,
                                                                 "temperature": 0.0}}
        reference = cluster["plain"].post_json("/generate", body)["output_ids"]
        thread, result = start_request(cluster, fake.address, body)
        ready = fake.receive()
        room = ready.room
        # Messages main cannot read: refused and counted, the channel and the request live on.
        fake.send_raw(b"not msgpack at all")
        fake.send_raw(msgspec.msgpack.encode(
            Envelope(version=99, body=HandoffReady(room=room))))
        fake.send_raw(b"\x00" * (MAX_MESSAGE_BYTES + 1))
        # Tokens for a room main does not hold: refused back to the sender.
        fake.send(HandoffTokens(room=room + 1, seq=0, start=0, token_ids=pack_tokens([5]),
                                is_last=True))
        assert fake.receive() == HandoffRefused(room=room + 1, reason="unknown_room")
        # A proper Catch-Up: a middle chunk, its repeat (ignored), then the last chunk.
        first = HandoffTokens(room=room, seq=0, start=0, token_ids=pack_tokens(reference[:10]),
                              is_last=False)
        fake.send(first)
        assert fake.receive() == HandoffAck(room=room, seq=0)
        fake.send(first)
        fake.send(HandoffTokens(room=room, seq=1, start=10,
                                token_ids=pack_tokens(reference[10:20]), is_last=True))
        thread.join(120)
        assert "error" not in result, result
        main = result["main"]
        assert main["output_ids"] == reference[20:]
        assert main["meta_info"]["completion_tokens"] == 30
        after = refused(cluster)
        for reason in ("malformed", "unknown_version", "oversized", "unknown_room",
                       "duplicate"):
            assert after.get(reason, 0) >= before.get(reason, 0) + 1, (reason, after)
    finally:
        fake.close()


@page1
def test_relay_refuses_strangers_and_keeps_serving(cluster):
    relay = cluster["relay"]
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.connect(relay_control_address(relay))
    try:
        socket.send(encode(HandoffReady(room=424242)))
        assert socket.poll(30000)
        assert decode(socket.recv()) == HandoffRefused(room=424242, reason="unknown_room")
        before = relay.pdd_state()["handoff"]["refused"]
        socket.send(b"\xc1garbage")
        socket.send(encode(HandoffAck(room=424242, seq=3)))
        socket.send(encode(HandoffTokens(room=1, seq=0, start=0, token_ids=b"", is_last=True)))
        import time
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            after = relay.pdd_state()["handoff"]["refused"]
            if (after.get("malformed", 0) > before.get("malformed", 0)
                    and after.get("unexpected_ack", 0) > before.get("unexpected_ack", 0)
                    and after.get("unexpected_type", 0) > before.get("unexpected_type", 0)):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"relay did not count the bad messages: {before} -> {after}")
    finally:
        socket.close(linger=0)
        context.term()
    assert relay.alive()


@page1
def test_a_request_the_relay_aborted_is_decoded_whole_by_main(cluster):
    """A relay whose KV never came (its transfer failed, its wait timed out) aborts the request
    before streaming anything: main must answer it, not abort too."""
    fake = FakeRelay()
    try:
        body = {"input_ids": words(43, 70), "sampling_params": {"max_new_tokens": 12,
                                                                 "temperature": 0.0}}
        reference = cluster["plain"].post_json("/generate", body)["output_ids"]
        thread, result = start_request(cluster, fake.address, body)
        ready = fake.receive()
        fake.send(HandoffRefused(room=ready.room, reason="aborted_at_relay"))
        thread.join(120)
        assert "error" not in result, result
        assert result["main"]["output_ids"] == reference
    finally:
        fake.close()


@page1
def test_an_abort_reaches_a_request_main_holds_for_the_handoff(cluster):
    """SGLang's /abort_request finds requests in its own queues; one that main holds for the
    handoff is dropped by the hook too, and the relay is told."""
    fake = FakeRelay()
    try:
        rid = "pdd-test-abort-held"
        body = {"input_ids": words(42, 60), "rid": rid,
                "sampling_params": {"max_new_tokens": 20, "temperature": 0.0}}
        thread, result = start_request(cluster, fake.address, body)
        ready = fake.receive()
        assert cluster["main"].pdd_state()["handoff"]["parked"] == 1
        request = urllib.request.Request(
            cluster["main"].url + "/abort_request", data=json.dumps({"rid": rid}).encode(),
            headers={"Content-Type": "application/json", **cluster["main"].headers})
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert resp.status == 200
        assert fake.receive() == HandoffRefused(room=ready.room, reason="aborted_at_main")
        thread.join(120)
        assert "error" in result, result
    finally:
        fake.close()


@page1
def test_main_refusing_the_last_chunk_leaves_the_relay_to_answer_whole(cluster):
    """The relay keeps a handed request until main acknowledges the last chunk. A main that
    refuses it (here: a fake main saying its tokens disagree, the divergence seen under load)
    costs the client nothing: the relay resumes the request and answers all of it."""
    body = {"input_ids": words(46, 90), "sampling_params": {"max_new_tokens": 40,
                                                             "temperature": 0.0,
                                                             "ignore_eos": True}}
    reference = cluster["plain"].post_json("/generate", body)["output_ids"]
    relay = cluster["relay"]
    resumed_before = relay.pdd_state()["handoff"]["events"].get("resumed", 0)
    # The real main talks to a fake relay (and is let go at the end); a fake main talks to the
    # real relay.
    fake_relay = FakeRelay()
    context = zmq.Context()
    fake_main = context.socket(zmq.DEALER)
    fake_main.connect(relay_control_address(relay))
    result: dict = {}

    def call():
        try:
            result.update(generate_pdd(cluster["prefill"], relay, cluster["main"], body,
                                       cluster.bootstrap_port, relay_control=fake_relay.address,
                                       debug_handoff_after_tokens=5,
                                       handoff_mode="one-shot"))
        except Exception as err:
            result["error"] = err

    thread = threading.Thread(target=call)
    thread.start()
    room = None
    try:
        room = fake_relay.receive().room
        fake_main.send(encode(HandoffReady(room=room)))
        assert fake_main.poll(60000)
        chunk = decode(fake_main.recv())
        assert isinstance(chunk, HandoffTokens) and chunk.is_last, chunk
        assert chunk.tokens == reference[:5]
        fake_main.send(encode(HandoffRefused(room=room, reason="mismatch")))
        thread.join(120)
        assert "error" not in result, result
        assert result["handed_tokens"] is None  # no handoff: the relay answered...
        assert result["output_ids"] == reference  # ...all of it, token for token
        assert result["relay"]["meta_info"]["finish_reason"]["type"] == "length"
        assert relay.pdd_state()["handoff"]["events"]["resumed"] == resumed_before + 1
    finally:
        if room is not None:  # main lets its copy go
            fake_relay.send(HandoffRefused(room=room, reason=FINISHED_AT_RELAY))
        thread.join(120)
        fake_main.close(linger=0)
        context.term()
        fake_relay.close()


# ---- a slow but healthy relay ------------------------------------------------------------------


class _SlowRelayPair:
    """The page-1 cluster's prefill and its second main (``main2``, started with a short
    ``--pdd-handoff-timeout``), for a fake relay to pace; main2 is "main" here."""

    def __init__(self, cluster):
        self.servers = {"prefill": cluster["prefill"], "main": cluster["main2"]}
        self.bootstrap_port = cluster.bootstrap_port
        self.handoff_timeout_s = cluster.main2_handoff_timeout_s

    def __getitem__(self, name):
        return self.servers[name]


@pytest.fixture
def slow_relay_pair(page1_cluster):
    pair = _SlowRelayPair(page1_cluster)
    before = {n: pair[n].wait_idle() for n in ("prefill", "main")}
    yield pair
    for name, pool in before.items():
        after = pair[name].wait_idle()
        assert after["in_use_tokens"] == 0 and after["locked_tokens"] == 0, (name, after)
        assert after["free_request_slots"] == pool["free_request_slots"], (name, after)
    assert pair["main"].pdd_state()["handoff"]["parked"] == 0


def main_events(pair) -> dict:
    return dict(pair["main"].pdd_state()["handoff"]["events"])


def greedy_case(pair, seed: int, max_new_tokens: int) -> tuple[dict, list[int], dict]:
    """A greedy request, main's own answer to it (P->MD: what a handoff must reproduce token for
    token), and main's handoff events before the handoff under test."""
    body = {"input_ids": words(seed, 90), "sampling_params": {"max_new_tokens": max_new_tokens,
                                                               "temperature": 0.0}}
    answer = generate_fanout(pair["prefill"], [pair["main"]], body, pair.bootstrap_port,
                             "prefill_main")[pair["main"].name]
    return body, answer["output_ids"], main_events(pair)


def test_a_catch_up_longer_than_the_timeout_completes_token_exact(slow_relay_pair):
    """Each chunk comes within the timeout of the last absorbed one, the whole Catch-Up takes
    three times the timeout: main keeps waiting (progress restarts its deadline) and its output
    is the greedy answer from the handoff point on."""
    pair = slow_relay_pair
    body, reference, before = greedy_case(pair, 44, 40)
    fake = FakeRelay()
    try:
        thread, result = start_request(pair, fake.address, body)
        room = fake.receive().room
        began = time.monotonic()
        chunk, chunks = 6, 5
        for seq in range(chunks):
            start = seq * chunk
            fake.send(HandoffTokens(room=room, seq=seq, start=start,
                                    token_ids=pack_tokens(reference[start:start + chunk]),
                                    is_last=False))
            assert fake.receive() == HandoffAck(room=room, seq=seq)
            time.sleep(0.7 * pair.handoff_timeout_s)  # silent, but under the timeout
        handed = chunks * chunk + 2
        fake.send(HandoffTokens(room=room, seq=chunks, start=chunks * chunk,
                                token_ids=pack_tokens(reference[chunks * chunk:handed]),
                                is_last=True))
        thread.join(120)
        took = time.monotonic() - began
        assert took > 3 * pair.handoff_timeout_s, took  # the case under test did happen
        assert "error" not in result, result
        main = result[pair["main"].name]
        assert main["output_ids"] == reference[handed:]
        assert main["meta_info"]["completion_tokens"] == 40
        after = main_events(pair)
        assert after.get("timeout", 0) == before.get("timeout", 0)
        assert after.get("timeout_mid_catch_up", 0) == before.get("timeout_mid_catch_up", 0)
        assert after["handoffs_absorbed"] == before.get("handoffs_absorbed", 0) + 1
    finally:
        fake.close()


def test_a_relay_silent_mid_catch_up_is_told_and_main_lets_go(slow_relay_pair):
    """Past the timeout with no chunk since the last absorbed one, main tells the relay
    (which then answers the request itself) and drops its copy with a clear reason."""
    pair = slow_relay_pair
    body, reference, before = greedy_case(pair, 45, 30)
    fake = FakeRelay()
    try:
        thread, result = start_request(pair, fake.address, body)
        room = fake.receive().room
        fake.send(HandoffTokens(room=room, seq=0, start=0, token_ids=pack_tokens(reference[:8]),
                                is_last=False))
        assert fake.receive() == HandoffAck(room=room, seq=0)
        assert fake.receive(timeout_s=10 * pair.handoff_timeout_s) == HandoffRefused(
            room=room, reason="timeout")
        thread.join(120)
        assert "failed on main" in str(result.get("error")), result
        after = main_events(pair)
        assert after["timeout_mid_catch_up"] == before.get("timeout_mid_catch_up", 0) + 1
    finally:
        fake.close()
