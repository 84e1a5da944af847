"""A tiny random-weight Llama whose tokenizer and chat template can show agentic behaviour.

The tiny model's word-level vocabulary cannot spell JSON and its template ignores tools, so tool
calls, structured output and reasoning cannot be tested on it. This model has:

- a byte-level BPE tokenizer trained with ``tokenizers`` on text made here from a fixed seed
  (JSON, tool-call markup, identifiers, digits), so every string, JSON included, has a spelling;
- ChatML markers as special tokens and the Qwen2.5 / Qwen3 markers ``<tool_call>``,
  ``</tool_call>``, ``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>`` as added
  tokens that are not special (as Qwen's own tokenizers have them), so they survive
  ``skip_special_tokens`` and SGLang's ``qwen25`` tool-call parser and ``qwen3`` reasoning parser
  apply to its output;
- a chat template in the Qwen2.5 style: ``tools`` in the system turn, assistant ``tool_calls`` as
  ``<tool_call>`` blocks, ``tool`` results as ``<tool_response>`` blocks in a user turn, an
  assistant's ``reasoning_content`` in ``<think>`` and Qwen3's ``enable_thinking=False`` empty
  think block.

Nothing is fetched from a hub. The weights are random (the tiny model's recipe), float32, with a
vocabulary exactly as large as the tokenizer's, so the logits are as wide as the vocabulary
xgrammar reads. The directory is cached under a hash of every setting and of the ``tokenizers``
version that trained it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from dataclasses import asdict
from pathlib import Path

from pdd_sglang.dev.testing.model_cache import build_once
from pdd_sglang.dev.testing.tiny_model import TinyModelSpec, default_cache_root

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added but not special: SGLang's detectors look for them in the detokenized text.
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                 "<think>", "</think>"]
BPE_VOCAB_SIZE = 2048
CORPUS_SEED = 20240607
CORPUS_DOCUMENTS = 3000

CHAT_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if message.reasoning_content %}{{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' }}{%- endif %}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{%- if loop.first and message.content or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
""".strip()

_WORDS = ("get weather city location unit celsius fahrenheit search query results file path read "
          "write list items name value count total user id status error message data time date "
          "temperature forecast days limit offset page order price amount currency email phone "
          "address country true false null the a of to and in is for on with that this as it be "
          "answer tool call function arguments type object string number integer boolean array "
          "properties required description enum title format minimum maximum").split()


def _identifier(rng: random.Random) -> str:
    parts = [rng.choice(_WORDS) for _ in range(rng.randint(1, 3))]
    return rng.choice(["_", ""]).join(parts) if rng.random() < 0.7 else "".join(
        p.capitalize() if i else p for i, p in enumerate(parts))


def _json_value(rng: random.Random, depth: int):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.randint(-100000, 100000)
    if kind == 1:
        return round(rng.uniform(-1000, 1000), rng.randint(0, 4))
    if kind == 2:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(0, 6)))
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {_identifier(rng): _json_value(rng, depth + 1) for _ in range(rng.randint(1, 5))}


def _document(rng: random.Random) -> str:
    """One training text: JSON, a tool call, a tool response, a reasoning block or prose."""
    obj = {_identifier(rng): _json_value(rng, 1) for _ in range(rng.randint(1, 6))}
    compact = rng.random() < 0.5
    text = json.dumps(obj, separators=(",", ":") if compact else None,
                      indent=rng.choice([None, 2, 4]) if not compact else None)
    kind = rng.randrange(5)
    if kind == 1:
        call = {"name": _identifier(rng), "arguments": obj}
        return "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"
    if kind == 2:
        return "<tool_response>\n" + text + "\n</tool_response>"
    if kind == 3:
        prose = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30)))
        return "<think>\n" + prose + "\n</think>\n\n" + prose.capitalize() + "."
    if kind == 4:
        return "".join(chr(rng.randint(32, 126)) for _ in range(rng.randint(10, 80)))
    return text


def training_corpus(seed: int = CORPUS_SEED, documents: int = CORPUS_DOCUMENTS) -> list[str]:
    rng = random.Random(seed)
    return [_document(rng) for _ in range(documents)]


def _build_tokenizer(path: Path) -> int:
    """Train and save the tokenizer; return its vocabulary size, added tokens included."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIAL_TOKENS)
    core.train_from_iterator(training_corpus(), trainer=trainer)
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return len(fast)


def _build_weights(spec: TinyModelSpec, vocab_size: int, ids: dict, path: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings, bos_token_id=None,
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # the tiny model's spread: greedy argmax without near-ties
        for param in model.parameters():
            param.normal_(0.0, 0.5 if param.dim() == 1 else 0.2)
    model.generation_config = GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"])
    model.to(torch.float32).save_pretrained(str(path), safe_serialization=True)


def digest(spec: TinyModelSpec) -> str:
    import tokenizers

    blob = json.dumps({"spec": asdict(spec), "special": SPECIAL_TOKENS, "markup": MARKUP_TOKENS,
                       "bpe": BPE_VOCAB_SIZE, "corpus": [CORPUS_SEED, CORPUS_DOCUMENTS],
                       "words": _WORDS, "template": CHAT_TEMPLATE,
                       "tokenizers": tokenizers.__version__}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_agentic_model(spec: TinyModelSpec | None = None, cache_root: Path | None = None) -> Path:
    """Return the directory of the agentic test model, building it on first use."""
    spec = spec or TinyModelSpec()
    root = cache_root or default_cache_root()

    def build(staging: Path) -> None:
        from tokenizers import Tokenizer

        vocab_size = _build_tokenizer(staging)
        core = Tokenizer.from_file(str(staging / "tokenizer.json"))
        _build_weights(spec, vocab_size, {t: core.token_to_id(t) for t in SPECIAL_TOKENS}, staging)
        (staging / "pdd_agentic_model.json").write_text(json.dumps(asdict(spec), indent=2))

    return build_once(root / "models" / f"agentic-llama-{digest(spec)}", build)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the agentic local test model.")
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    print(ensure_agentic_model(cache_root=args.cache_dir))


if __name__ == "__main__":
    main()
