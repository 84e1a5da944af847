"""Constrained decoding with the agentic test model (``pdd_sglang.dev.testing.agentic_model``), on
real servers of its own (``conftest.py``: ``_agentic_grammar``): a plain server answers ``regex`` and
``json_schema`` (greedy and sampled) within their constraints on SGLang's CPU engine, and a
``json_schema`` answer handed off from the relay to main mid-answer is the plain server's, token
for token, with main's grammar advanced over exactly the handed tokens.

The model's byte-level vocabulary is read by xgrammar as it decodes (``BYTE_LEVEL``), so any
JSON has a spelling and no constraint leaves a dead end the tiny model's word vocabulary has.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pdd_sglang.dev.testing.pd_client import generate_pdd

from test_handoff import back_to_baseline

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "alerts": {"type": "array", "items": {"type": "boolean"}, "minItems": 8, "maxItems": 8},
    },
    "required": ["city", "unit", "days", "alerts"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3,8}( [a-z]{3,8}){2}, [0-9]{3}"


@pytest.fixture(scope="module")
def agentic(shared_clusters):
    cluster = shared_clusters.take_beside("agentic_grammar")  # started beside the TP tests
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def baselines(agentic):
    with back_to_baseline(agentic) as before:
        yield before


@pytest.fixture(scope="module")
def tokenizer(agentic):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(agentic["plain"].model_path))


def chat_prompt(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_regex_and_json_schema_hold_on_a_plain_server(agentic, baselines, tokenizer):
    plain = agentic["plain"]
    ids = chat_prompt(tokenizer, "Name three words and a number.")
    text = plain.post_json("/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 64, "temperature": 0.0, "regex": REGEX}})["text"]
    assert re.fullmatch(REGEX, text), text
    ids = chat_prompt(tokenizer, "The weather in Paris, as JSON.")
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "sampling_seed": 7}):
        answer = plain.post_json("/generate", {"input_ids": ids, "sampling_params": {
            "max_new_tokens": 160, "json_schema": json.dumps(SCHEMA), **sampling}})
        assert answer["meta_info"]["finish_reason"]["type"] == "stop", answer
        jsonschema.validate(json.loads(answer["text"]), SCHEMA)


def test_a_json_schema_answer_handed_off_mid_answer_is_the_plain_servers(
        agentic, baselines, tokenizer):
    ids = chat_prompt(tokenizer, "The weather in Oslo for the week, as JSON.")
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 160, "temperature": 0.0,
                                                  "json_schema": json.dumps(SCHEMA)}}
    reference = agentic["plain"].post_json("/generate", body)
    jsonschema.validate(json.loads(reference["text"]), SCHEMA)
    expected = reference["output_ids"]
    assert len(expected) > 30, reference
    # One-Shot mid-answer; Catch-Up from mid-answer in chunks of 8 (several middle chunks).
    for point, mode in [(11, "one-shot"), (17, "catch-up")]:
        before = agentic["main"].pdd_state()["handoff"]["events"]
        answer = generate_pdd(agentic["prefill"], agentic["relay"], agentic["main"], body,
                              agentic.bootstrap_port, debug_handoff_after_tokens=point,
                              handoff_mode=mode)
        handed = answer["handed_tokens"]
        assert handed is not None and point <= handed < len(expected), (mode, handed)
        assert answer["output_ids"] == expected, (mode, point, handed)
        after = agentic["main"].pdd_state()["handoff"]["events"]
        # Main's grammar accepted the handed tokens (the prefill's first among them) once each,
        # before its extend sampled the next token from that state.
        assert (after.get("grammar_tokens_accepted", 0)
                - before.get("grammar_tokens_accepted", 0)) == handed, (mode, handed)
        assert after.get("handoffs_absorbed", 0) == before.get("handoffs_absorbed", 0) + 1
