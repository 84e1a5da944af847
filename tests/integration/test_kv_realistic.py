"""PDD at a real model's KV size (issue 50): copies of the KV-realistic model (``KV_8B_MODEL``:
Llama-3-8B's 32 layers x 8 KV heads x head dim 128, 256 KiB a token in float32) through real
prefill, relay and main servers, handed off relay -> main, token for token against a plain
server of the same model (``conftest.py``: ``kv_8b_cluster``).

A room of 120 tokens (30 MiB) fits main's staging range (``--pdd-wan-staging-mb``, 64 MiB), so it
crosses as records; one of 300 tokens (75 MiB) does not, and crosses however the prefill sends a
room that outgrows the range. Main checks each copy against the relay's (the KV digest), so a
page scattered to the wrong place fails here even where the tokens agree.
"""

from __future__ import annotations

from pdd_sglang.dev.testing.conversation import FIRST_WORD_ID, WORDS
from pdd_sglang.dev.testing.pd_client import generate_pdd
from pdd_sglang.dev.testing.tiny_model import KV_8B_MODEL
from pdd_sglang.dev.testing.wan_copies import MODES, copies_by_mode, copy_mode

MAX_NEW_TOKENS = 24
# (prompt tokens, forced handoff point, handoff mode)
COPIES = ((120, 3, "one-shot"), (300, 8, "catch-up"))


def words(seed: int, count: int) -> list[int]:
    return [FIRST_WORD_ID + (seed * 131 + i * 7) % WORDS for i in range(count)]


def main_row(prefill, room: int) -> dict:
    rows = [r for r in prefill.pdd_state()["transfers"]["by_request"]
            if r["room"] == room and r["role"] == "main"]
    assert len(rows) == 1, rows
    return rows[0]


def test_32_layer_copies_are_token_exact_through_a_handoff(kv_8b_cluster):
    cluster = kv_8b_cluster
    prefill = cluster["prefill"]
    names = ("prefill", "relay", "main")
    before = {n: cluster[n].wait_idle() for n in names}
    verified_before = cluster["relay"].pdd_state()["handoff"]["events"].get(
        "kv_digest_verified", 0)
    modes = []
    for seed, (tokens, point, handoff) in enumerate(COPIES):
        body = {"input_ids": words(seed + 50, tokens),
                "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0,
                                    "ignore_eos": True}}
        reference = cluster["plain"].post_json("/generate", body)["output_ids"]
        assert len(reference) == MAX_NEW_TOKENS
        copies = copies_by_mode(prefill)
        answer = generate_pdd(prefill, cluster["relay"], cluster["main"], body,
                              cluster.bootstrap_port, debug_handoff_after_tokens=point,
                              handoff_mode=handoff)
        handed = answer["handed_tokens"]
        assert handed is not None and handed >= point, (tokens, answer["relay"])
        assert answer.get("mode") == handoff, answer["relay"]["meta_info"]
        assert answer["output_ids"] == reference, (tokens, handed)
        # The whole prompt's KV crossed to main: every layer of every token.
        row = main_row(prefill, answer["room"])
        assert row["pages"] == tokens and row["bytes"] == tokens * KV_8B_MODEL.kv_bytes_per_token
        modes.append(copy_mode(copies, copies_by_mode(prefill)))
    print(f"\n32-layer copies to main by mode: "
          f"{dict(zip((t for t, _, _ in COPIES), modes))}")
    assert modes[0] in ("packed", "coded") and set(modes) <= set(MODES), modes
    # main's copy matched the relay's, layer for layer, before each handoff
    verified = cluster["relay"].pdd_state()["handoff"]["events"]["kv_digest_verified"]
    assert verified == verified_before + len(COPIES)
    for name in names:
        after = cluster[name].wait_idle()
        assert after["in_use_tokens"] == 0 and after["locked_tokens"] == 0, (name, after)
        assert after["free_request_slots"] == before[name]["free_request_slots"], (name, after)
    assert cluster.dead_servers() == []
