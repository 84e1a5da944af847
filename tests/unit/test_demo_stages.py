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
