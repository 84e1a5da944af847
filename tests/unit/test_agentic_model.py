"""The agentic test model: its tokenizer spells any JSON, its template renders tools, tool calls,
tool results and reasoning as Qwen2.5 / Qwen3 do, and SGLang's qwen25 tool-call parser, qwen3
reasoning parser and xgrammar read what it makes."""

import json

import pytest

from pdd_sglang.dev.testing.agentic_model import MARKUP_TOKENS, SPECIAL_TOKENS, ensure_agentic_model
from pdd_sglang.dev.testing.tiny_model import TinyModelSpec

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_agentic_model(cache_root=tmp_path_factory.mktemp("agentic"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.mark.parametrize("text", [
    '{"city": "Paris", "days": 3}',
    '{"a":[1,-2.5e-3,true,false,null],"b":{"c":"\\u00e9\\n\\"q\\""}}',
    'héllo 中文 😀 \t\r\n ~`!@#$%^&*()',
    "get_weather(city='Zürich', n=1234567890)",
])
def test_any_text_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode()) or len(text) < 12  # BPE merges, not bytes alone


def test_markers_are_single_tokens_and_survive_skip_special(tokenizer, model_dir):
    for token in SPECIAL_TOKENS + MARKUP_TOKENS:
        assert tokenizer.convert_ids_to_tokens(tokenizer.encode(token, add_special_tokens=False)) \
            == [token]
    ids = tokenizer.encode("<|im_start|><tool_call>\n{}\n</tool_call><|im_end|>",
                           add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<tool_call>\n{}\n</tool_call>"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer)
    assert config["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_template_renders_tools_calls_and_results_that_sglang_parses(tokenizer):
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.qwen25_detector import Qwen25Detector

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "b", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "b", "content": '{"temp": 25}'},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                         add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in text
    assert ("<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n"
            "<tool_response>\n{\"temp\": 25}\n</tool_response><|im_end|>\n") in text
    assert text.endswith("<|im_start|>assistant\n")
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    result = Qwen25Detector().detect_and_parse(turn, [Tool(**t) for t in TOOLS])
    assert [(c.name, json.loads(c.parameters)) for c in result.calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    plain = tokenizer.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True)
    assert plain == "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n<|im_start|>assistant\n"


def test_reasoning_renders_and_qwen3_splits_it(tokenizer):
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "add them"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    answer = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert answer == "<think>\nadd them\n</think>\n\n4"
    reasoning, normal = ReasoningParser("qwen3").parse_non_stream(answer)
    assert (reasoning.strip(), normal.strip()) == ("add them", "4")
    off = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True,
                                        enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_xgrammar_reads_a_byte_level_vocabulary_as_wide_as_the_logits(tokenizer, model_dir):
    import xgrammar

    width = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=width)
    assert info.vocab_type == xgrammar.VocabType.BYTE_LEVEL
    assert info.stop_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_json_schema(
        json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                    "required": ["n"]})))
    for token in tokenizer.encode('{"n": 42}', add_special_tokens=False):
        assert matcher.accept_token(token)
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()


def test_cached_by_settings(model_dir, tmp_path):
    root = model_dir.parents[1]
    assert ensure_agentic_model(cache_root=root) == model_dir
    other = ensure_agentic_model(TinyModelSpec(seed=7), cache_root=root)
    assert other != model_dir
    assert (other / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
