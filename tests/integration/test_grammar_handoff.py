"""A constrained request across the relay -> main handoff, on real servers (P, RLD, MD and the
plain reference of the page-1 cluster).

Main must advance the request's grammar over the prefill's first token and the relay's handed
tokens before it samples the next one (``pdd_sglang.decode.handoff_grammar``). xgrammar reads the
tiny model's vocabulary as raw token strings (``w5``: the space its decoder puts between words is
in no token), so the regex below is written over those, with one-digit words only: a token such
as ``w1`` is a prefix of ``w12``, and a grammar that accepted it where ``w12`` was due would have
no token left to finish the word. Position k of the answer must be one of the three words of
``CYCLE[k % 3]``; a grammar left at the wrong state picks from the wrong three.
"""

from __future__ import annotations

import pytest

from pdd_sglang.protocol.messages import HandoffReady, HandoffRefused, HandoffTokens, pack_tokens
from pdd_sglang.dev.testing.conversation import FIRST_WORD_ID
from pdd_sglang.dev.testing.pd_client import generate_pdd

from test_handoff import baselines  # noqa: F401 (fixture: every pool back to its baseline)
from test_handoff_bad_input import FakeRelay, refused, start_request, words

CYCLE = [(1, 2, 3), (4, 5, 6), (7, 8, 9)]
REGEX = "(" + "".join("(" + "|".join(f"w{w}" for w in group) + ")" for group in CYCLE) + "){70}"
MAX_NEW_TOKENS = 100  # of 210: the grammar allows no stop token before its end
page1 = pytest.mark.parametrize("three_roles", [1], indirect=True, ids=["page1"])


def constrained(max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "regex": REGEX}


def allowed_at(position: int) -> set[int]:
    return {FIRST_WORD_ID + w for w in CYCLE[position % len(CYCLE)]}


def accepted(cluster) -> int:
    return cluster["main"].pdd_state()["handoff"]["events"].get("grammar_tokens_accepted", 0)


@page1
def test_a_regex_answer_handed_off_mid_answer_is_the_plain_servers(three_roles, baselines):
    cluster = three_roles
    body = {"input_ids": words(50, 120), "sampling_params": constrained()}
    reference = cluster["plain"].post_json("/generate", body)["output_ids"]
    assert len(reference) == MAX_NEW_TOKENS
    assert all(token in allowed_at(k) for k, token in enumerate(reference)), reference
    # One-Shot mid-cycle; Catch-Up in two chunks of 64 (a middle chunk, then the last).
    for point, mode in [(7, "one-shot"), (70, "catch-up")]:
        before = accepted(cluster)
        answer = generate_pdd(cluster["prefill"], cluster["relay"], cluster["main"], body,
                              cluster.bootstrap_port, debug_handoff_after_tokens=point,
                              handoff_mode=mode)
        handed = answer["handed_tokens"]
        assert handed is not None and handed >= point, (mode, answer["relay"]["meta_info"])
        assert answer["output_ids"] == reference, (mode, point, handed)
        assert len(answer["main"]["output_ids"]) == MAX_NEW_TOKENS - handed
        # Main's grammar accepted every handed token (the prefill's first among them) before
        # its extend, and nothing twice: its state is the plain server's at that position.
        assert accepted(cluster) - before == handed, (mode, handed)


@page1
def test_main_refuses_handed_tokens_its_grammar_does_not_accept(three_roles, baselines):
    cluster = three_roles
    fake = FakeRelay()
    try:
        before = refused(cluster).get("grammar_refused", 0)
        body = {"input_ids": words(51, 80), "sampling_params": constrained(20)}
        thread, result = start_request(cluster, fake.address, body)
        ready = fake.receive()
        assert isinstance(ready, HandoffReady)
        first = cluster["plain"].post_json("/generate", body)["output_ids"][0]
        # Position 1 must be one of CYCLE[1]'s words; a word of CYCLE[0] breaks the regex.
        bad = FIRST_WORD_ID + CYCLE[0][0]
        assert bad not in allowed_at(1)
        fake.send(HandoffTokens(room=ready.room, seq=0, start=0,
                                token_ids=pack_tokens([first, bad]), is_last=True))
        assert fake.receive() == HandoffRefused(room=ready.room, reason="grammar_refused")
        thread.join(120)
        assert not thread.is_alive()
        # Main's client gets an error, main's log names the token; the request is gone
        # everywhere (the fixture's checks).
        assert "failed on main" in str(result.get("error")), result
        assert (f"token {bad} at output position 1 is not accepted by the request's grammar"
                in cluster["main"].log_path.read_text())
        assert refused(cluster).get("grammar_refused", 0) == before + 1
    finally:
        fake.close()
