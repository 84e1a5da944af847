"""The served model as the router needs it: names, context length, tokenizer, KV bytes per token.

The tokenizer is off the hot path: text prompts go to the servers as text, their token counts
estimated (:mod:`pdd_sglang.router.prompt`). It serves what needs exact tokens: a prompt whose
count could reach the context limit, a retry that resends the prompt plus the client's tokens,
and the text of main's tokens after a handoff. (A chat's prompt comes as ids from a prefill,
rendered and tokenized by SGLang's own code: router/chat_translation.py.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from pdd_sglang.router.detokenize import detokenizer_for
from pdd_sglang.router.prompt import TokenEstimate

# An English sample whose tokens per byte start the estimate (the servers' counts then correct
# it, answer by answer).
_SAMPLE_TEXT = ("The router places each request on a path through the servers, and splices the "
                "answers of the relay and the main decode server into one stream for the client. "
                "Placement weighs the prefix each main holds against its load.")

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "fp8_e4m3": 1,
                "fp8_e5m2": 1}


@dataclass
class ModelInfo:
    model_path: str
    served_model_name: str
    context_length: int
    tokenizer: Any
    kv_bytes_per_token: float
    estimate: TokenEstimate = field(default_factory=TokenEstimate)
    _detokenizers: dict = field(default_factory=dict, repr=False, compare=False)

    def known_names(self) -> set[str]:
        # SGLang answers to its served name, its path and "default" (its protocol's default).
        return {self.served_model_name, self.model_path, "default"}

    # ---- tokenization -------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool) -> Optional[Callable]:
        """How the router decodes main's tokens after a handoff (router/detokenize.py)."""
        key = bool(skip_special_tokens)
        if key not in self._detokenizers:
            self._detokenizers[key] = detokenizer_for(self.tokenizer, key)
        return self._detokenizers[key]


def kv_bytes_per_token_from_config(model_path: str, dtype: Optional[str]) -> Optional[float]:
    """2 (K and V) x layers x KV heads x head dim x dtype bytes; None when the config lacks them
    (MLA and other compressed layouts: pass --kv-bytes-per-token)."""
    config_path = Path(model_path) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)
    layers = config.get("num_hidden_layers")
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads", heads)
    hidden = config.get("hidden_size")
    head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    if not (layers and kv_heads and head_dim) or "kv_lora_rank" in config:
        return None
    dtype = dtype if dtype and dtype != "auto" else config.get("torch_dtype", "bfloat16")
    return float(2 * layers * kv_heads * head_dim * _DTYPE_BYTES.get(str(dtype), 2))


def load_model_info(model_info: dict, server_info: dict, tokenizer_path: Optional[str],
                    kv_bytes_override: Optional[float]) -> ModelInfo:
    """Build ModelInfo from a server's /model_info and /server_info answers."""
    from transformers import AutoTokenizer  # heavy: only when the router starts

    model_path = model_info["model_path"]
    path = tokenizer_path or model_info.get("tokenizer_path") or model_path
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    context = server_info.get("context_length") or getattr(tokenizer, "model_max_length", None)
    if not context or context > 10**9:
        context = _context_from_config(model_path)
    kv_bytes = kv_bytes_override or kv_bytes_per_token_from_config(
        model_path, server_info.get("kv_cache_dtype") if server_info.get("kv_cache_dtype") not in
        (None, "auto") else server_info.get("dtype"))
    return ModelInfo(
        model_path=model_path,
        served_model_name=model_info.get("served_model_name") or model_path,
        context_length=int(context),
        tokenizer=tokenizer,
        kv_bytes_per_token=kv_bytes or 50 * 1024.0,  # the brief's 1T-class figure
        estimate=estimate_for(tokenizer),
    )


def estimate_for(tokenizer: Any) -> TokenEstimate:
    """The estimate's start: the tokens the tokenizer adds to any text, and a sample's tokens
    per byte."""
    specials = len(tokenizer.encode(""))
    sample = len(tokenizer.encode(_SAMPLE_TEXT)) - specials
    return TokenEstimate(max(sample, 1) / len(_SAMPLE_TEXT.encode()), specials)


def _context_from_config(model_path: str) -> int:
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return 4096
    config = config.get("text_config", config)
    return int(config.get("max_position_embeddings", 4096))
