"""Agentic chats through the PDD router at parity with SGLang's own server, on the agentic test
model (tools rendered by its template, a byte-level BPE that spells JSON and Qwen's markup) and
real servers: the prompt's token ids and sampling parameters the router sends are the ones
SGLang's own chat serving builds in-process, and the greedy answer through the router, P->MD
and through a handoff, is the plain server's, ``tool_calls`` and ``reasoning_content`` included
(router and servers run SGLang's Qwen parsers)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import AGENTIC_PARSERS
from test_router import SERVER_KEY, assert_idle, post, post_stream

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [{"role": "system", "content": "You answer about the weather."},
           {"role": "user", "content": "What is the weather in Paris today?"},
           {"role": "assistant", "content": "", "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'},
           {"role": "user", "content": "And in celsius?"}]
SHORT = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0}


def _requests() -> list[dict]:
    """Tools, tool calls and results, tool_choice, logit_bias, response_format and
    chat_template_kwargs: what SGLang's translation turns into the prompt and the sampling."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    return [
        {"messages": HISTORY, "tools": TOOLS, "max_tokens": 8, **GREEDY},
        {"messages": HISTORY, "tools": TOOLS, "tool_choice": "none", "logit_bias": {"16": -2.0},
         "max_tokens": 8, **GREEDY},
        {"messages": HISTORY, "tools": TOOLS, "tool_choice": "required", "max_tokens": 8},
        {"messages": HISTORY, "tools": TOOLS, "max_tokens": 8,
         "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"messages": SHORT, "response_format": {"type": "json_object"}, "max_tokens": 8},
        {"messages": SHORT, "max_tokens": 8, "response_format": {
            "type": "json_schema", "json_schema": {"name": "city", "schema": schema}}},
        {"messages": SHORT, "chat_template_kwargs": {"enable_thinking": False},
         "max_tokens": 8, "top_k": 5, "stop": ["\n\n"], **GREEDY},
        {"messages": SHORT, "separate_reasoning": False, "max_completion_tokens": 8,
         "seed": 3, "presence_penalty": 0.5},
    ]


def _in_process(model_path, bodies: list[dict]) -> list[dict]:
    """SGLang's own translation of ``bodies``, in a process of its own (chat_reference.py)."""
    done = subprocess.run(
        [sys.executable, "-m", "pdd_sglang.dev.testing.chat_reference", "--model-path",
         str(model_path), *AGENTIC_PARSERS], input=json.dumps(bodies), capture_output=True,
        text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_the_prompt_and_sampling_the_router_sends_are_sglangs_own(agentic_cluster):
    bodies = _requests()
    reference = _in_process(agentic_cluster.model_path, bodies)
    prefill, plain = agentic_cluster["prefill"].url, agentic_cluster["plain"].url
    for body, want in zip(bodies, reference):
        assert "error" not in want, (body, want)
        status, got = post(prefill, "/pdd/chat_request", body, key=SERVER_KEY)
        assert status == 200, got
        assert got["prompt"]["input_ids"] == want["input_ids"], body
        assert got["sampling_params"] == want["sampling_params"], body
        if "response_format" in body or body.get("tool_choice", "auto") not in ("auto", "none"):
            continue  # constrained decoding on the CPU engine is not this test's
        # The plain server reports the same prompt for the same chat.
        _, answer = post(plain, "/v1/chat/completions",
                         {**body, "max_tokens": 1, "return_prompt_token_ids": True},
                         key=SERVER_KEY)
        assert answer["choices"][0]["prompt_token_ids"] == want["input_ids"]
    # Tools reach the template, tool calls and results too: the chats differ in their prompts.
    assert len({tuple(r["input_ids"]) for r in reference}) >= 3


def _message(answer: dict) -> tuple:
    choice = answer["choices"][0]
    message = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in message.get("tool_calls") or ()]
    return (message["content"], message.get("reasoning_content"), calls,
            choice["finish_reason"], answer["usage"]["prompt_tokens"],
            answer["usage"]["completion_tokens"])


def _streamed(chunks: list[dict]) -> tuple:
    content = reasoning = ""
    calls: dict = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or ():
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] += call["function"].get("name") or ""
                entry[1] += call["function"].get("arguments") or ""
    finish = [c["finish_reason"] for chunk in chunks for c in chunk.get("choices") or ()
              if c.get("finish_reason")]
    return content, reasoning, sorted(map(tuple, calls.values())), finish


# A short chat's prompt is under the router's 100-token boundary (P->MD); the tool chat's is
# over it, and its 512-token answer outlasts main's delayed copy: the relay hands off.
CASES = [("prefill_main", {"messages": SHORT, "max_tokens": 12}, "main"),
         ("prefill_relay_main", {"messages": HISTORY, "tools": TOOLS, "max_tokens": 512,
                                 "ignore_eos": True}, "handoff")]


@pytest.mark.parametrize("pipeline,body,outcome", CASES, ids=[c[0] for c in CASES])
def test_greedy_answers_through_the_router_are_the_plain_servers(agentic_cluster, pipeline,
                                                                 body, outcome):
    router, plain = agentic_cluster.router.url, agentic_cluster["plain"].url
    body = {**body, **GREEDY}
    _, want = post(plain, "/v1/chat/completions", body, key=SERVER_KEY)
    status, got = post(router, "/v1/chat/completions", body)
    assert status == 200, got
    assert got["metadata"]["pdd"]["pipeline"] == pipeline
    assert got["metadata"]["pdd"]["outcome"] == outcome
    assert _message(got) == _message(want)
    streamed = {**body, "stream": True}
    assert _streamed(post_stream(router, "/v1/chat/completions", streamed)) == \
        _streamed(post_stream(plain, "/v1/chat/completions", streamed, key=SERVER_KEY))
    assert_idle(agentic_cluster)
