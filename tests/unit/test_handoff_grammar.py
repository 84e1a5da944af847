"""Main advances a constrained request's grammar over the handed-off tokens before its extend
(``pdd_sglang.decode.handoff_grammar``), with SGLang's own xgrammar backend over the tiny model's
vocabulary; a token the grammar refuses fails that request at main, told to the relay."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from pdd_sglang.decode.handoff_grammar import advance_over_output
from pdd_sglang.dev.testing.conversation import FIRST_WORD_ID
from pdd_sglang.protocol.control_channel import ControlLoop
from pdd_sglang.protocol.messages import HandoffRefused

# One-digit words: none is a prefix of another (tests/integration/test_grammar_handoff.py).
REGEX = "((w1|w2)(w3|w4)(w5|w6))+"
W = {n: FIRST_WORD_ID + n for n in range(10)}


@pytest.fixture(scope="module")
def backend():
    import json

    from transformers import AutoTokenizer
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    from pdd_sglang.dev.testing.tiny_model import ensure_tiny_model

    path = ensure_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    return XGrammarGrammarBackend(tokenizer, vocab_size=vocab,
                                  model_eos_token_ids=[tokenizer.eos_token_id])


def allowed(grammar, vocab: int) -> set[int]:
    mask = grammar.allocate_vocab_mask(vocab, 1, "cpu")
    grammar.fill_vocab_mask(mask, 0)
    import torch

    logits = torch.zeros(1, vocab)
    grammar.apply_vocab_mask(logits, mask)
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def test_the_grammar_is_advanced_over_the_handed_tokens_in_chunks(backend):
    vocab = backend.vocab_size
    req = SimpleNamespace(grammar=backend.dispatch_regex(REGEX), output_ids=[W[2]])
    assert allowed(req.grammar, vocab) == {W[1], W[2]}  # nothing accepted yet: the start state
    req.output_ids += [W[3], W[6]]  # a middle Catch-Up chunk
    assert advance_over_output(req, 0) == (3, None)
    req.output_ids += [W[1], W[4]]  # the last chunk
    assert advance_over_output(req, 3) == (5, None)
    # The next token is masked from the state after the handed tokens: the third group.
    assert allowed(req.grammar, vocab) == {W[5], W[6]}
    assert advance_over_output(SimpleNamespace(grammar=None, output_ids=[1, 2]), 0) == (2, None)


def test_a_refused_token_is_named_with_its_position(backend):
    req = SimpleNamespace(grammar=backend.dispatch_regex(REGEX), output_ids=[W[1], W[3], W[3]])
    upto, refusal = advance_over_output(req, 0)
    assert upto == 2
    assert refusal == (f"the handed-off token {W[3]} at output position 2 is not accepted by "
                       "the request's grammar")


def test_main_drops_a_request_whose_handed_tokens_break_its_grammar(backend):
    from pdd_sglang.decode.main import Held, MainHandoff, _Parked

    relay = ControlLoop(relay_bind="tcp://127.0.0.1:0")
    args = SimpleNamespace(pdd_control_keypair=None, pdd_control_relay_key=None,
                           pdd_control_authorized_keys=None, host="127.0.0.1",
                           pdd_control_port=0, pdd_handoff_timeout=30.0,
                           pdd_enable_kv_digest=False)
    scheduler = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(size=8), max_running_requests=8,
        token_to_kv_pool_allocator=SimpleNamespace(page_size=1, available_size=lambda: 1000),
        tree_cache=SimpleNamespace(evictable_size=lambda: 0))
    main = MainHandoff(scheduler, args)
    try:
        released = []
        main._release = lambda req, message, cache: released.append((req.bootstrap_room, message))
        req = SimpleNamespace(bootstrap_room=7, rid="r7", grammar=backend.dispatch_regex(REGEX),
                              output_ids=[W[1], W[3], W[3]], origin_input_ids=[W[0]] * 10,
                              kv=SimpleNamespace(kv_committed_len=10))
        now = time.monotonic()
        main.parked[7] = _Parked(req, relay.address, now, now + 30, state=Held.TOKENS_QUEUED,
                                 is_last=True)
        assert main._next_extend(SimpleNamespace(batch_size=lambda: 0)) is None  # no extend
        assert released == [(7, "PDD handoff refused: the handed-off token "
                                f"{W[3]} at output position 2 is not accepted by the request's "
                                "grammar")]
        assert main.parked == {}
        item = relay.wait_received(5)
        assert item is not None and item[1] == HandoffRefused(room=7, reason="grammar_refused")
        state = main.state()
        assert state["refused"]["grammar_refused"] == 1
        assert state["events"]["grammar_tokens_accepted"] == 2
    finally:
        main.close()
        relay.close()
