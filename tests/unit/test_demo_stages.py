"""The demo's TTFT stage split: it adds up to the client's TTFT from marks on the router's and the
prefill scheduler's clocks, and SGLang's tokenizer-side ``request_received_ts`` (seconds off in a
full demo here) does not move it."""

from __future__ import annotations

import pytest

from pdd_sglang.dev.demo.report import STAGES, paired_excess, stage_split

SENT = 1_000_000.0


def row_and_stats(received_ts_offset_s: float) -> tuple[dict, dict]:
    # client sends at 0; the router posts to prefill at 0.05, forward 0.30-0.80, router's first
    # token 0.90, client's 0.91
    row = {"sent_ts": SENT, "ttft_s": 0.91,
           "marks": {"prefill_sent_ts": SENT + 0.05, "first_token_ts": SENT + 0.90}}
    stats = {"request_received_ts": SENT + 0.06 + received_ts_offset_s,
             "forward_entry_time": SENT + 0.30, "prefill_finished_time": SENT + 0.80,
             "queue_time": 0.10}
    return row, stats


@pytest.mark.parametrize("offset_s", [0.0, -21.3, 6.4])
def test_the_split_adds_up_and_ignores_the_tokenizers_clock(offset_s):
    split = stage_split(*row_and_stats(offset_s))
    assert set(split) == set(STAGES)
    assert sum(split.values()) == pytest.approx(0.91, abs=1e-3)
    assert split == pytest.approx({"router_to_prefill": 0.05, "registration_wait": 0.15,
                                   "prefill_queue": 0.10, "prefill_forward": 0.50,
                                   "kv_and_first_token": 0.10, "router_to_client": 0.01},
                                  abs=1e-3)


def test_a_missing_mark_gives_no_split():
    row, stats = row_and_stats(0.0)
    del row["marks"]["prefill_sent_ts"]
    assert stage_split(row, stats) is None


def _row(conversation: int, turn: int, outcome: str, **stages: float) -> dict:
    split = {s: 0.0 for s in STAGES} | stages
    return {"conversation": conversation, "turn": turn, "outcome_kind": outcome,
            "ttft_s": sum(split.values()), "stages": split}


def test_paired_excess_matches_the_same_request_and_its_stages_add_up():
    same = {"rows": [_row(0, 0, "main", prefill_forward=0.5),
                     _row(0, 1, "main", prefill_forward=0.4, kv_and_first_token=0.1),
                     _row(1, 0, "main", prefill_forward=0.6)]}
    pdd = {"rows": [_row(1, 0, "handoff_one_shot", prefill_forward=0.5),  # listed out of order
                    _row(0, 1, "main", prefill_forward=0.4, kv_and_first_token=0.6),
                    _row(0, 0, "handoff_one_shot", prefill_forward=0.5),
                    _row(2, 0, "main", prefill_forward=9.0),  # no same-DC twin: not paired
                    {**_row(0, 2, "error"), "stages": None}]}
    table = paired_excess(same, pdd)
    assert table["pairs"] == 3
    # differences per pair: -0.1 (1,0), +0.5 (0,1), 0.0 (0,0)
    assert table["ttft_diff_p50_s"] == pytest.approx(0.0, abs=1e-4)
    assert table["ttft_diff_mean_s"] == pytest.approx(0.4 / 3, abs=1e-4)
    assert sum(table["stage_diff_mean_s"].values()) == pytest.approx(table["ttft_diff_mean_s"],
                                                                     abs=1e-3)
    assert table["stage_diff_mean_s"]["kv_and_first_token"] == pytest.approx(0.5 / 3, abs=1e-4)
    assert table["by_pdd_outcome"]["main"]["ttft_diff_mean_s"] == pytest.approx(0.5, abs=1e-4)
    assert table["by_pdd_outcome"]["handoff_one_shot"]["pairs"] == 2


def test_paired_excess_without_a_pair_says_so():
    assert paired_excess({"rows": []}, {"rows": [_row(0, 0, "main")]}) == {"pairs": 0}


# SGLang 0.5.23's ReqTimeStats lines (--enable-request-time-stats-logging), as a demo logged them.
PREFILL_LOG = (
    "[2026-12-03 23:56:39] ReqTimeStats(rid=pdd-1, bootstrap_room=2987855802426173317, "
    "input_len=1032, cached_input_len=0, output_len=1, attempts=0, type=prefill): "
    "bootstrap_duration=69.19ms, queue_duration=0.82ms, forward_duration=435.30ms, "
    "entry_time=1000000.300, transfer_speed=0.19 GB/s, transfer_total=8.06 MB\n"
    "[2026-12-03 23:56:39] ReqTimeStats(rid=HEALTH_CHECK_1, bootstrap_room=0, input_len=1, "
    "cached_input_len=0, output_len=1, attempts=0, type=prefill): bootstrap_duration=0.13ms, "
    "queue_duration=9.84ms, forward_duration=149.38ms, entry_time=1000000.000, "
    "transfer_speed=0.00 GB/s, transfer_total=0.00 MB\n")
RELAY_LOG = (
    "[2026-12-03 23:57:46] ReqTimeStats(rid=pdd-1, bootstrap_room=1193961848724003141, "
    "input_len=1032, cached_input_len=0, output_len=4, attempts=0, type=decode): "
    "bootstrap_duration=17.37ms, alloc_wait_duration=1.17ms, transfer_duration=400.32ms, "
    "queue_duration=0.29ms, forward_duration=78.84ms, entry_time=1000000.080\n")


def test_the_intake_split_reads_each_servers_time_stats(tmp_path):
    """registration_wait split by server: when the prefill's scheduler took the request in (a
    forward in progress delays it), when the relay's did, and when the relay sent its slots."""
    from pdd_sglang.dev.demo.report import intake_of, intake_table, scheduler_intake_from_logs

    (tmp_path / "prefill.log").write_text(PREFILL_LOG)
    (tmp_path / "relay.log").write_text(RELAY_LOG)
    intake = scheduler_intake_from_logs({"prefill": tmp_path / "prefill.log",
                                         "relay": tmp_path / "relay.log",
                                         "main": tmp_path / "absent.log"})
    assert set(intake) == {"pdd-1", "HEALTH_CHECK_1"}
    row = {"marks": {"prefill_sent_ts": SENT + 0.05}}
    split = intake_of(row, intake["pdd-1"])
    assert list(split) == ["prefill received", "relay received", "relay registered"]
    assert split == pytest.approx({"prefill received": 0.25, "relay received": 0.03,
                                   "relay registered": 0.03 + 0.01737 + 0.00117}, abs=1e-4)
    assert intake_of({"marks": {}}, intake["pdd-1"]) is None
    table = intake_table([{"intake": split}, {"intake": None}])
    assert table["prefill received"]["p50_s"] == pytest.approx(0.25)


def test_a_setups_wan_bytes_count_the_copies_that_land_after_its_last_answer():
    """The line's counters were read at the last answer, while cache-only copies (last in order,
    in a small window) were still crossing, and the next setup's baseline is read once they
    landed: their tail counted nowhere, and the simulator, which counts every byte, was 1.2-2.1x
    the measured bytes. The setup's bytes are now read once its copies landed; the line's load
    stays the bytes in the run over the run."""
    from pdd_sglang.dev.demo import report

    summary = report.summarize([], {}, {"a_to_b": 3000, "b_to_a": 500}, 100, 2.0, "cluster B",
                               0.01, wan_in_run={"a_to_b": 2000, "b_to_a": 400})
    assert summary["wan_bytes"] == 3500
    assert summary["wan_bytes_after_last_answer"] == 1100
    assert summary["line_utilisation_a_to_b"] == 0.8  # 2000 B x 8 over 10 kbit/s x 2 s
