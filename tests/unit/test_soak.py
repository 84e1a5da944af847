"""The chaos soak's pure parts: its multi-turn load, the counters it sums over restarts, the log
scan that names dead threads, the token check's near-ties, and the bar a soak.json must clear."""

from __future__ import annotations

from pdd_sglang.dev.faults import faults
from pdd_sglang.dev.faults.checks import HANDLED, NEAR_TIE_NATS, Greedy, bar, judge, scan_log
from pdd_sglang.dev.faults.load import Sent
from pdd_sglang.dev.faults.soak import MAX_TURNS, PROFILE, CounterSum, MultiTurnLoad
from pdd_sglang.dev.testing.agentic import RequestResult


def _answer(load: MultiTurnLoad, client: int, error: str | None = None) -> dict:
    number, body = load._next_body(client)
    result = RequestResult(client, number, len(body["input_ids"]), 0,
                           body["sampling_params"]["max_new_tokens"])
    result.output_ids = [7] * body["sampling_params"]["max_new_tokens"]
    result.error = error
    load._finished(client, Sent(result, 0.0, 1.0, body))
    return body


def test_turns_resend_the_history_with_the_answers_and_a_failed_turn_ends_the_conversation():
    load = MultiTurnLoad("127.0.0.1", 1, PROFILE, seed=3)
    first = _answer(load, 0)
    assert first["input_ids"][:PROFILE.shared_tokens] == load._prefix  # the system prompt
    second = _answer(load, 0)
    answered = first["input_ids"] + [7] * first["sampling_params"]["max_new_tokens"]
    assert second["input_ids"][:len(answered)] == answered
    assert len(second["input_ids"]) > len(answered)  # a new tool result or document
    _answer(load, 0, error="HTTP 503")
    fresh = _answer(load, 0)
    assert not fresh["input_ids"][:len(answered)] == answered  # a new conversation
    for _ in range(MAX_TURNS):
        last = _answer(load, 1)
    assert len(_answer(load, 1)["input_ids"]) < len(last["input_ids"])  # turn limit: anew
    again = MultiTurnLoad("127.0.0.1", 1, PROFILE, seed=3)
    assert _answer(again, 0) == first  # seeded


def test_a_counter_is_summed_over_the_restarts_of_its_server():
    counter = CounterSum()
    for value in (0, 2, 5, 1, 3, 0, 4):
        counter.see(value)
    assert counter.total == 5 + 3 + 4
    counter.restarted()  # the soak killed its server, whose next count may already be higher
    counter.see(6)
    assert counter.total == 5 + 3 + 4 + 6


def _greedy(ids: list, runner_ups: dict | None = None) -> Greedy:
    """A reference answer whose best token leads its runner-up (token 1) by 2 nats, except at
    ``runner_ups``: index -> (runner-up, gap)."""
    runner_ups = runner_ups or {}
    top2 = []
    for i, token in enumerate(ids):
        other, gap = runner_ups.get(i, (1, 2.0))
        top2.append(((token, 0.0), (other, -gap)))
    return Greedy(ids, top2)


class _Reference:
    """The reference's continuation of each prompt it is asked about: prompt length -> tokens."""

    def __init__(self, continuations: dict):
        self.continuations, self.asked = continuations, []

    def __call__(self, input_ids: list, params: dict) -> Greedy:
        self.asked.append((len(input_ids), params["max_new_tokens"]))
        return _greedy(self.continuations[len(input_ids)][:params["max_new_tokens"]])


BODY = {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0,
                                                     "ignore_eos": True}}


def test_an_answer_that_takes_the_runner_up_at_a_near_tie_is_checked_on_from_there():
    """The soak's pdd-b9fe221cf5c3-88 (2026-12-04): the relay's answer left the reference's at an
    output token whose best two were 5.2e-6 nats apart. Such an answer is no mismatch if it took
    the runner-up and the reference, asked to go on from the answer's own tokens, agrees with
    the rest; it is listed as a near-tie."""
    expected = _greedy([20, 21, 22, 23, 24, 25], {2: (40, 5.2e-6)})
    got = [20, 21, 40, 41, 42, 43]
    reference = _Reference({13: [41, 42, 43]})
    ties, mismatch = judge(got, BODY, expected, reference)
    assert mismatch is None
    assert ties == [{"index": 2, "gap": 5.2e-6, "token": 40, "reference_token": 22}]
    assert reference.asked == [(10 + 3, 3)]  # the prompt and got[:3]; the 3 tokens left
    assert judge(list(expected.ids), BODY, expected, reference) == ([], None)


def test_a_divergence_past_the_tie_margin_or_off_the_runner_up_or_after_the_tie_is_a_mismatch():
    got = [20, 21, 40, 41, 42, 43]
    wide = _greedy([20, 21, 22, 23, 24, 25], {2: (40, NEAR_TIE_NATS * 2)})
    assert judge(got, BODY, wide, _Reference({})) == (
        [], {"first_diff": 2, "reference_gap": NEAR_TIE_NATS * 2})
    not_second = _greedy([20, 21, 22, 23, 24, 25], {2: (39, 5e-6)})  # 40 was not its runner-up
    assert judge(got, BODY, not_second, _Reference({}))[1] == {"first_diff": 2,
                                                                 "reference_gap": 5e-6}
    tie = _greedy([20, 21, 22, 23, 24, 25], {2: (40, 5e-6)})
    ties, mismatch = judge(got, BODY, tie, _Reference({13: [41, 9, 43]}))  # wrong after the tie
    assert [t["index"] for t in ties] == [2]
    assert mismatch == {"first_diff": 4, "reference_gap": 2.0}
    short = _greedy([20, 21, 22, 23, 24], {4: (1, 5e-6)})  # one token longer than the reference
    assert judge([20, 21, 22, 23, 24, 1], BODY, short, _Reference({}))[1] == {
        "first_diff": 5, "reference_gap": None}


def test_at_an_exact_tie_the_other_token_is_the_one_the_reference_did_not_take():
    """Measured on the plain server: at a gap of 0 it took token 388 while its top-2 list put
    783 first (argmax takes the lower ID). An answer with 783 there is a near-tie."""
    tie = Greedy([20, 388, 22], [((20, 0.0), (1, -2.0)), ((783, -7.0), (388, -7.0)),
                                 ((22, 0.0), (1, -2.0))])
    reference = _Reference({12: [22]})
    assert judge([20, 783, 22], BODY, tie, reference) == (
        [{"index": 1, "gap": 0.0, "token": 783, "reference_token": 388}], None)


def test_a_near_tie_at_the_last_token_needs_no_continuation():
    expected = _greedy([20, 21, 22], {2: (40, 1e-6)})
    reference = _Reference({})
    assert judge([20, 21, 40], BODY, expected, reference)[1] is None
    assert reference.asked == []


def test_the_log_scan_names_dead_threads_once_each(tmp_path):
    log = tmp_path / "prefill.log"
    before = "Traceback (most recent call last):\nValueError: before the soak\n"
    log.write_text(before + "\n".join([
        "[2026-12-03 07:00:00] INFO: fine",
        "Exception in thread Thread-3 (transfer_worker):",
        "Traceback (most recent call last):",
        '  File "conn.py", line 2900, in transfer_worker',
        "    raise RuntimeError(",
        "RuntimeError: Transfer thread failed because of x. Prefill instance with "
        "bootstrap_port=1 is dead.",
        "[2026-12-03 07:00:01 TP0] Scheduler hit an exception: Traceback (most recent call last):",
        '  File "scheduler.py", line 1, in event_loop',
        "KeyError: 5",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "Traceback (most recent call last):",
        '  File "scheduler.py", line 2, in event_loop',
        "AssertionError: room 5",
        "[2026-12-03 07:00:02] INFO: still logging",
        "[2026-12-03 07:00:03] post-warmup freeze_gc failed",
        "Traceback (most recent call last):",
        '  File "http_server.py", line 2561, in _freeze_gc_after_server_warmup',
        "requests.exceptions.ConnectionError: refused",
    ]) + "\n")
    found = scan_log(log, offset=len(before))
    assert found == [
        {"thread": "Thread-3 (transfer_worker)",
         "error": "RuntimeError: Transfer thread failed because of x. Prefill instance with "
                  "bootstrap_port=1 is dead."},
        {"thread": "[2026-12-03 07:00:01 TP0] Scheduler hit an exception",
         "error": "AssertionError: room 5"},
        {"thread": "[2026-12-03 07:00:03] post-warmup freeze_gc failed",
         "error": "requests.exceptions.ConnectionError: refused",
         "handled": HANDLED["post-warmup freeze_gc failed"]},
    ]
    assert len(scan_log(log)) == 4
    assert scan_log(tmp_path / "absent.log") == []


def _report(**changes) -> dict:
    zero = {"prefill": 0, "relay": 0, "main": 0}
    report = {"requests": 10, "completed": 9, "lost": 0, "errored": 1,
              "errors": [{"reason": "HTTP 503"}], "token_mismatches": 0, "digest_mismatches": 0,
              "leaked_slots": zero, "leaked_locks": zero, "leaked_rooms": zero,
              "dead_threads": [], "faults": {"relay_dies": 1}, "recovery_s": {"relay_dies": [4.2]},
              "minutes": 2, "seed": 0}
    return {**report, **changes}


def test_the_bar():
    assert bar(_report()) == []
    assert bar(_report(lost=1)) == ["lost: 1"]
    assert bar(_report(token_mismatches=2, digest_mismatches=1)) == [
        "token_mismatches: 2", "digest_mismatches: 1"]
    assert bar(_report(leaked_rooms={"prefill": None, "relay": 0, "main": 0})) == [
        "leaked_rooms: {'prefill': None}"]
    assert bar(_report(leaked_slots={"prefill": 0, "relay": 16, "main": 0})) == [
        "leaked_slots: {'relay': 16}"]
    assert bar(_report(dead_threads=[{"server": "main", "thread": "pdd-control"}])) == [
        "dead_threads: 1"]
    assert bar(_report(recovery_s={"relay_dies": [None]})) == ["no recovery after: ['relay_dies']"]
    assert bar(_report(completed=0)) == ["no request completed"]


def test_the_soak_draws_every_fault_kind_the_issue_names():
    names = {f.name for f in faults.SOAK}
    assert {"relay_dies", "main_dies_before_handoff", "wan_short_stall", "wan_stall",
            "wan_batch_fails", "main_registers_late", "clients_disconnect",
            "chunked_prefill_backed_up"} <= names
    assert len(names) == len(faults.SOAK)


def test_the_batch_failure_waits_for_a_copy_on_the_wan_path():
    class Prefill:
        lines: dict = {}

        def pdd_state(self):
            return {"wan_line": self.lines}

    cluster = type("Cluster", (), {"prefill": Prefill()})()
    assert faults.WAN_STALL.ready(cluster)  # strikes whatever is on the line
    assert not faults.WAN_BATCH_FAILS.ready(cluster)
    Prefill.lines = {"10.77.0.2:1": {"bytes_ahead": 0}}
    assert not faults.WAN_BATCH_FAILS.ready(cluster)
    Prefill.lines = {"10.77.0.2:1": {"bytes_ahead": 8192}}
    assert faults.WAN_BATCH_FAILS.ready(cluster)
    assert faults.WAN_BATCH_FAILS.hold_s > 10  # past the suite's --pdd-wan-transfer-timeout


def test_the_line_floor_is_the_uncached_kv_over_the_line_alone():
    from pdd_sglang.dev.faults.suite import line_floor_s
    from pdd_sglang.dev.testing.tiny_model import WAN_DEMO_MODEL
    # 700 tokens of 8 KiB at 10 Mbit/s: 5,734,400 B * 8 / 1e7 = 4.59 s.
    assert WAN_DEMO_MODEL.kv_bytes_per_token == 8192
    assert line_floor_s(10.0, 700) == 4.59
    assert line_floor_s(0.0, 700) is None  # an unlimited line has no floor
