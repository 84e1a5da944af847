"""A real PD pair on CPU: SGLang prefill (--pdd-role prefill) and decode (--pdd-role main) over
Mooncake TCP, with the decode radix cache that --pdd-role main turns on.

A multi-turn conversation shares a growing prefix. The decode side must hit its own cache on later
turns, and the KV bytes that prefill hands to Mooncake (measured at the sender by patch 0003) must
cover only the suffix that decode's tree lacks.
"""

from __future__ import annotations

from pdd_sglang.dev.testing.conversation import run_conversation, sent_for_room

MAX_NEW_TOKENS = 8
# The cluster is shared: a prompt no other test sends, so its first turn is a miss everywhere.
PROMPT_SEED = 97


def sent_to_main(prefill_state: dict, room: int) -> dict:
    rows = sent_for_room(prefill_state, room)
    assert len(rows) == 1, f"expected one destination for room {room}, got {rows}"
    return rows[0]


def test_multi_turn_sends_only_the_uncached_suffix(pd_pair, tiny_model):
    spec, _ = tiny_model
    prefill, main = pd_pair["prefill"], pd_pair["main"]
    main_before = main.wait_idle()
    prefill_before = prefill.wait_idle()

    turns = run_conversation(prefill, main, pd_pair.bootstrap_port, turns=4, system_len=120,
                             user_len=24, max_new_tokens=MAX_NEW_TOKENS,
                             seed=PROMPT_SEED)
    answers = [t.answer for t in turns]
    cached = [t.cached_tokens for t in turns]
    for answer in answers:
        assert answer["meta_info"]["finish_reason"]["type"] == "length"
        assert len(answer["output_ids"]) == MAX_NEW_TOKENS
    assert cached[0] == 0
    assert all(later > earlier for earlier, later in zip(cached, cached[1:])), cached

    state = prefill.pdd_state()
    for turn in turns:
        row = sent_to_main(state, turn.room)
        uncached = len(turn.prompt) - turn.cached_tokens
        # Measured at the sender vs. what decode's tree lacked: equal, page size 1.
        assert row["pages"] == uncached, (row, uncached)
        assert row["bytes"] == uncached * spec.kv_bytes_per_token, (row, uncached)
    full = sum(len(t.prompt) for t in turns) * spec.kv_bytes_per_token
    sent = sum(sent_to_main(state, t.room)["bytes"] for t in turns)
    assert sent < 0.5 * full, (sent, full)

    # Nothing leaks: no slot held, no tree lock, on either side; main's tree keeps the history.
    for server, before in ((prefill, prefill_before), (main, main_before)):
        after = server.wait_idle()
        assert after["in_use_tokens"] == 0 and after["locked_tokens"] == 0, (server.name, after)
        assert after["free_request_slots"] == before["free_request_slots"], (server.name, after)
        assert server.alive(), server.log_tail()
    main_after = main.wait_idle()
    assert main_after["evictable_tokens"] > main_before["evictable_tokens"]
    assert (main_before["available_tokens"] - main_after["available_tokens"]) == (
        main_after["evictable_tokens"] - main_before["evictable_tokens"]
    )


def test_roles_resolved_to_sglang_modes(pd_pair):
    prefill_info = pd_pair["prefill"].get_json("/server_info")
    main_info = pd_pair["main"].get_json("/server_info")
    assert prefill_info["disaggregation_mode"] == "prefill"
    assert main_info["disaggregation_mode"] == "decode"
    assert main_info["disaggregation_decode_enable_radix_cache"] is True
    assert prefill_info["pdd_role"] == "prefill" and main_info["pdd_role"] == "main"
