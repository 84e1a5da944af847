"""A tiny random-weight Llama with a local word-level tokenizer, made with a fixed seed.

Nothing is fetched from a hub. The model is written once to a cache directory whose name carries
a hash of its settings, so a changed preset never reuses a stale copy. Float32 keeps greedy
decoding reproducible across processes (bf16 ties flip argmax between batch shapes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from pdd_sglang.dev.testing.model_cache import build_once

VOCAB_WORDS = 1000
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
# A minimal chat template, so OpenAI chat endpoints work on the tiny model.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}assistant : {% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    seed: int = 1234
    # A head dim apart from hidden_size // num_attention_heads (written as the config's
    # ``head_dim``, which SGLang's Llama reads): a real model's KV geometry beside a small hidden
    # size. None keeps the computed one, and the cache key of every model made without it.
    head_dim_override: Optional[int] = None

    @property
    def head_dim(self) -> int:
        if self.head_dim_override is not None:
            return self.head_dim_override
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """float32 K and V for every layer: what one token of KV costs on the wire."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 4

    def digest(self) -> str:
        fields = asdict(self)
        if fields["head_dim_override"] is None:  # the key of the models made before the field
            del fields["head_dim_override"]
        blob = json.dumps(fields, sort_keys=True) + f"|v{VOCAB_WORDS}|{CHAT_TEMPLATE}"
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


# The model of the WAN demo and the fault suite: still tiny for the CPU, but with 4 layers x 8 KV
# heads x head dim 32 in float32 its KV costs 8 KiB per token, so a 1000-token document is 8 MB on
# the wire and its copy over a 10-20 Mbit/s emulated line takes seconds.
WAN_DEMO_MODEL = TinyModelSpec(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=8,
                               max_position_embeddings=8192)

# KV-realistic models for the checks at a real model's size: Llama-3-8B's KV geometry (32 layers x
# 8 KV heads x head dim 128; 256 KiB of KV a token in float32, 128 KiB in bf16) and Llama-3-70B's
# depth (80 layers; 640 KiB a token in float32), with hidden and MLP sizes kept small so a prefill
# stays cheap on a few CPU cores. Size a server's KV pool for them (--max-total-tokens): 4,096
# tokens at 32 layers is 1 GiB.
KV_8B_MODEL = TinyModelSpec(hidden_size=256, intermediate_size=512, num_hidden_layers=32,
                            num_attention_heads=8, num_key_value_heads=8,
                            max_position_embeddings=8192, head_dim_override=128)
KV_80_LAYER_MODEL = TinyModelSpec(hidden_size=256, intermediate_size=512, num_hidden_layers=80,
                                  num_attention_heads=8, num_key_value_heads=8,
                                  max_position_embeddings=8192, head_dim_override=128)


def default_cache_root() -> Path:
    return Path(os.environ.get("PDD_CACHE_DIR", Path.home() / ".cache" / "pdd-sglang"))


def word(i: int) -> str:
    """The i-th ordinary word of the tiny vocabulary; prompts are built from these."""
    return f"w{i}"


def _build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i in range(VOCAB_WORDS):
        vocab[word(i)] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def _build_weights(spec: TinyModelSpec, path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_WORDS + len(SPECIAL_TOKENS),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        head_dim=spec.head_dim,
        bos_token_id=SPECIAL_TOKENS.index("<s>"),
        eos_token_id=SPECIAL_TOKENS.index("</s>"),
        pad_token_id=SPECIAL_TOKENS.index("<pad>"),
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    # Larger-than-default init spreads the logits, so greedy argmax has no near-ties.
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5 if param.dim() == 1 else 0.2)
    model.to(torch.float32).save_pretrained(str(path), safe_serialization=True)


def ensure_tiny_model(spec: TinyModelSpec | None = None, cache_root: Path | None = None) -> Path:
    """Return the directory of the tiny model, building it on first use."""
    spec = spec or TinyModelSpec()
    root = cache_root or default_cache_root()

    def build(staging: Path) -> None:
        _build_weights(spec, staging)
        _build_tokenizer(staging)
        (staging / "pdd_tiny_model.json").write_text(json.dumps(asdict(spec), indent=2))

    return build_once(root / "models" / f"tiny-llama-{spec.digest()}", build)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the tiny local test model.")
    parser.add_argument("--cache-dir", type=Path, default=None)
    for name, value in asdict(TinyModelSpec()).items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=value)
    args = parser.parse_args(argv)
    fields = {k: getattr(args, k) for k in asdict(TinyModelSpec())}
    print(ensure_tiny_model(TinyModelSpec(**fields), args.cache_dir))


if __name__ == "__main__":
    main()
