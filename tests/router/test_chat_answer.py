"""Chat completions at parity with SGLang: every request field honoured or refused by name, and
tool calls and reasoning parsed from a spliced answer (relay then main) as SGLang's parsers
parse the whole text. No servers: the splicer and the formatter, with the agentic test model's
tokenizer (a byte-level BPE that spells JSON and Qwen's tool-call markup)."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdd_sglang.dev.testing.agentic_model import ensure_agentic_model
from pdd_sglang.router.chat_answer import answer_for
from pdd_sglang.router.chat_fields import HONOURED, REFUSED, check_fields
from pdd_sglang.router.errors import RequestRejected
from pdd_sglang.router.openai_format import OpenAIStream
from pdd_sglang.router.splice import StreamSplicer, UpstreamChunk

MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string"}},
                   "required": ["city"]}}}]
ANSWER = ('<think>\nThe user wants the weather; call the tool.\n</think>\n\n'
          'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')
# Values a client could send for a field, tried in order: the first SGLang's model takes.
CANDIDATES = (True, 2, "selected", ["x"], {"a": 1})


def _asking(model, name: str) -> dict:
    """A body SGLang's model takes with ``name`` set to something other than its default."""
    default = model.model_fields[name].default
    for value in CANDIDATES:
        body = {"messages": MESSAGES, name: value}
        try:
            model.model_validate(dict(body))  # (its validators may move fields)
        except ValueError:
            continue
        if value != default:
            return body
    raise AssertionError(f"no candidate value validates for {name}")


def test_every_field_of_sglangs_chat_request_is_honoured_or_refused_by_name():
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    fields = set(ChatCompletionRequest.model_fields)
    assert not HONOURED & set(REFUSED)
    # A field SGLang adds (or drops) fails here until chat_fields.py sorts it.
    assert fields == HONOURED | set(REFUSED), (fields - HONOURED - set(REFUSED),
                                               (HONOURED | set(REFUSED)) - fields)
    for name in REFUSED:
        body = _asking(ChatCompletionRequest, name)
        with pytest.raises(RequestRejected) as info:
            check_fields(body)
        assert info.value.message.startswith(f"{name} is not supported"), name
        assert info.value.status == 400
        # The field's default is not a request for it.
        default = ChatCompletionRequest.model_fields[name].default
        check_fields({"messages": MESSAGES, name: default})
    image = [{"type": "text", "text": "what is this?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    with pytest.raises(RequestRejected) as info:
        check_fields({"messages": [{"role": "user", "content": image}]})
    assert info.value.message.startswith("messages[0].content[1] of type 'image_url'")
    with pytest.raises(RequestRejected) as info:
        check_fields({"messages": MESSAGES, "stream_options": {"continuous_usage_stats": True}})
    assert "stream_options.continuous_usage_stats" in info.value.message
    check_fields({"messages": MESSAGES, "stream_options": {"include_usage": True}})


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ensure_agentic_model()))


def _context(**overrides) -> dict:
    """What a prefill's /pdd/chat_request answers for the request (prefill/chat_request.py)."""
    return {"tools": TOOLS, "tool_call_parsing": True, "force_reasoning": False,
            "history_tool_calls": 0, "parser_prefix": "", "constrained": False,
            "own_encoding": False, "tool_call_parser": "qwen25", "reasoning_parser": "qwen3",
            **overrides}


def _sglang_whole(text: str):
    """SGLang's parsers over the whole text, as its chat server runs them."""
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    reasoning, text = ReasoningParser("qwen3", stream_reasoning=False).parse_non_stream(text)
    parser = FunctionCallParser([Tool.model_validate(t) for t in TOOLS], "qwen25")
    normal, calls = parser.parse_non_stream(text)
    return reasoning, normal, [(c.name, json.loads(c.parameters)) for c in calls]


def _sglang_streamed_content(deltas: list[str]) -> str:
    """The content SGLang's streaming parsers let through for these text deltas (it depends on
    where the deltas fall: a parser holds back what may start a tool call)."""
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    reasoning = ReasoningParser("qwen3", stream_reasoning=True)
    calls = FunctionCallParser([Tool.model_validate(t) for t in TOOLS], "qwen25")
    content = ""
    for i, delta in enumerate(deltas):
        _, normal = reasoning.parse_stream_chunk(delta)
        if i == len(deltas) - 1:
            normal = (normal or "") + (reasoning.parse_stream_end()[1] or "")
        text, _ = calls.parse_stream_chunk(normal or "")
        content += text or ""
    return content + (calls.parse_stream_end()[0] or "")


def _spliced(tokenizer, ids: list[int], handed: int, step: int = 3):
    """The updates of an answer the relay streams up to ``handed`` tokens, then main."""
    splicer = StreamSplicer(with_relay=True,
                            decode=lambda i: tokenizer.decode(i, skip_special_tokens=False))
    meta = {"id": "chat-1", "prompt_tokens": 40, "cached_tokens": 0}
    updates = []
    for end in range(step, handed, step):
        updates.append(splicer.relay_chunk(UpstreamChunk(ids[:end], None, dict(meta), False)))
    handoff = {"type": "pdd_handoff", "handed_tokens": handed}
    updates.append(splicer.relay_chunk(UpstreamChunk(ids[:handed], None,
                                                     {**meta, "finish_reason": handoff}, True)))
    rest = ids[handed:]
    for end in range(step, len(rest) + step, step):
        end = min(end, len(rest))
        last = end == len(rest)
        chunk_meta = {**meta, "completion_tokens": handed + end,
                      "finish_reason": {"type": "stop", "matched": 151645} if last else None}
        updates.append(splicer.main_chunk(UpstreamChunk(rest[:end], None, chunk_meta, last)))
        if last:
            break
    assert splicer.outcome == "handoff"
    return [u for u in updates if u is not None]


def _streamed(formatter: OpenAIStream, updates) -> list[dict]:
    async def run():
        chunks = []
        for update in updates:
            chunks += await formatter.parsed_chunks(update)
        return chunks
    return asyncio.run(run())


def _calls_of(chunks: list[dict]):
    calls: dict = {}
    for chunk in chunks:
        for call in chunk["choices"][0]["delta"].get("tool_calls") or ():
            entry = calls.setdefault(call["index"], {"name": None, "arguments": "", "ids": []})
            if call["function"].get("name"):
                entry["name"] = call["function"]["name"]
            entry["arguments"] += call["function"].get("arguments") or ""
            if call.get("id"):
                entry["ids"].append(call["id"])
    return calls


@pytest.mark.parametrize("cut", ["in_reasoning", "in_markup", "in_arguments"])
def test_a_spliced_tool_call_answer_parses_as_sglang_parses_the_whole_text(tokenizer, cut):
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == ANSWER
    where = {"in_reasoning": ANSWER.index("weather;"), "in_markup": ANSWER.index("<tool_call>") + 3,
             "in_arguments": ANSWER.index("Paris") + 2}[cut]
    handed = next(n for n in range(len(ids) + 1)
                  if len(tokenizer.decode(ids[:n], skip_special_tokens=False)) >= where)
    assert 0 < handed < len(ids)
    reasoning, normal, calls = _sglang_whole(ANSWER)
    assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    body = {"messages": MESSAGES, "tools": TOOLS}

    # Whole: the last update, as a non-streamed answer.
    updates = _spliced(tokenizer, ids, handed)
    assert updates[-1].text == ANSWER
    answer = answer_for(body, _context(), "qwen25", "qwen3", tokenizer)
    whole = OpenAIStream(True, "m", answer=answer).response(updates[-1])
    choice = whole["choices"][0]
    assert choice["message"]["reasoning_content"] == reasoning
    assert choice["message"]["content"] == normal
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
           for c in choice["message"]["tool_calls"]]
    assert got == calls and choice["finish_reason"] == "tool_calls"

    # Streamed: the deltas of every update, through SGLang's streaming parsers.
    answer = answer_for(body, _context(), "qwen25", "qwen3", tokenizer)
    chunks = _streamed(OpenAIStream(True, "m", answer=answer), updates)
    streamed_reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content") or ""
                                 for c in chunks if c["choices"])
    streamed_content = "".join(c["choices"][0]["delta"].get("content") or ""
                               for c in chunks if c["choices"])
    assert streamed_reasoning.strip() == reasoning.strip()
    deltas = [u.text[len(before):] for before, u in zip([""] + [u.text for u in updates], updates)]
    assert streamed_content == _sglang_streamed_content(deltas)
    streamed = _calls_of(chunks)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == calls
    assert all(len(c["ids"]) == 1 for c in streamed.values())  # one id per call
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_no_parser_no_parsing_and_a_mismatched_parser_is_refused(tokenizer):
    body = {"messages": MESSAGES, "tools": TOOLS}
    none = _context(tool_call_parser=None, reasoning_parser=None, tool_call_parsing=False)
    assert answer_for(body, none, None, None, tokenizer) is None
    # tool_choice "none" (SGLang's server then parses no tool call) and no reasoning parser.
    assert answer_for(body, _context(tool_call_parsing=False, reasoning_parser=None), "qwen25",
                      None, tokenizer) is None
    # A deprecated name is the parser a server resolves it to (qwen25: qwen).
    assert answer_for(body, _context(tool_call_parser="qwen"), "qwen25", "qwen3",
                      tokenizer) is not None
    # Servers that parse behind a router that does not: their answers would differ.
    with pytest.raises(RequestRejected):
        answer_for(body, _context(), None, None, tokenizer)
    with pytest.raises(RequestRejected) as info:
        answer_for(body, _context(tool_call_parser="hermes"), "qwen25", "qwen3", tokenizer)
    assert "--tool-call-parser qwen25" in info.value.message
