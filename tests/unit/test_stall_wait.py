"""A PDD scheduler with nothing to run but work in flight backs off instead of spinning."""

from types import SimpleNamespace

import zmq

from pdd_sglang.stall import FIRST_PAUSE_S, LONGEST_PAUSE_S, StallWait


def test_the_pause_doubles_while_nothing_changes_and_restarts_on_progress():
    slept = []
    scheduler = SimpleNamespace(forward_ct=0, waiting_queue=[], disagg_prefill_inflight_queue=["r"])
    waiter = StallWait(scheduler, sleep=slept.append)
    for _ in range(12):
        waiter.wait()
    assert slept[0] == FIRST_PAUSE_S and slept[1] == 2 * FIRST_PAUSE_S
    assert max(slept) == LONGEST_PAUSE_S and slept[-1] == LONGEST_PAUSE_S
    scheduler.disagg_prefill_inflight_queue = []  # the transfer landed: progress
    waiter.wait()
    assert slept[-1] == FIRST_PAUSE_S


def test_a_new_request_wakes_the_wait_at_once():
    context = zmq.Context.instance()
    receiver, sender = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    port = receiver.bind_to_random_port("tcp://127.0.0.1")
    sender.connect(f"tcp://127.0.0.1:{port}")
    try:
        scheduler = SimpleNamespace(ipc_channels=SimpleNamespace(recv_from_tokenizer=receiver,
                                                                 recv_from_rpc=None))
        waiter = StallWait(scheduler, sleep=lambda s: (_ for _ in ()).throw(AssertionError))
        waiter.pause_s = 3600.0  # would block for an hour without input
        waiter._progress = waiter.progress()
        sender.send(b"request")
        assert waiter.wait() == 3600.0  # returned: the socket had input
        assert receiver.recv(zmq.NOBLOCK) == b"request"  # and left it for the scheduler to read
    finally:
        sender.close(0)
        receiver.close(0)
