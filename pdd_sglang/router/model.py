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


class ModelUnknown(RuntimeError):
    """The router could not learn what it must know of the model: it refuses to start."""


def _config(model_path: str) -> Optional[dict]:
    """The model's config.json (its text model's part), None when the router cannot read it."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("text_config", config)


def kv_bytes_per_token_from_config(model_path: str, dtype: Optional[str]) -> Optional[float]:
    """2 (K and V) x layers x KV heads x head dim x dtype bytes; None when the config lacks them
    (MLA and other compressed layouts), or names no dtype this knows (transformers 5 writes
    ``dtype``, older releases ``torch_dtype``)."""
    config = _config(model_path)
    if config is None:
        return None
    layers = config.get("num_hidden_layers")
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads", heads)
    hidden = config.get("hidden_size")
    head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    if not (layers and kv_heads and head_dim) or "kv_lora_rank" in config:
        return None
    if not dtype or dtype == "auto":
        dtype = config.get("dtype") or config.get("torch_dtype")
    if str(dtype) not in _DTYPE_BYTES:
        return None
    return float(2 * layers * kv_heads * head_dim * _DTYPE_BYTES[str(dtype)])


def _pdd_state(server_info: dict) -> dict:
    states = server_info.get("internal_states") or [{}]
    return (states[0] or {}).get("pdd") or {}


def load_model_info(model_info: dict, server_info: dict, tokenizer_path: Optional[str],
                    kv_bytes_override: Optional[float], trust_remote_code: bool,
                    source: str = "main") -> ModelInfo:
    """Build ModelInfo from a server's /model_info and /server_info answers (``source`` names
    that server); ModelUnknown, naming each thing it could not learn, rather than a guess."""
    from transformers import AutoTokenizer  # heavy: only when the router starts

    model_path = model_info["model_path"]
    path = tokenizer_path or model_info.get("tokenizer_path") or model_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001 - whatever transformers raises, the operator reads
        raise ModelUnknown(f"refusing to start: cannot load the tokenizer from {path!r} "
                           f"({err}); set --tokenizer-path to the model's tokenizer (or "
                           "--trust-remote-code where it needs its own code)") from err
    pdd, config = _pdd_state(server_info), _config(model_path) or {}
    context = (pdd.get("context_length") or server_info.get("context_length")
               or config.get("max_position_embeddings"))
    kv_dtype = server_info.get("kv_cache_dtype")
    kv_bytes = (kv_bytes_override or pdd.get("kv_bytes_per_token")
                or kv_bytes_per_token_from_config(model_path, kv_dtype if kv_dtype not in
                                                  (None, "auto") else server_info.get("dtype")))
    missing = []
    if not context:
        missing.append(f"the context length ({source}'s /server_info has no "
                       "pdd.context_length, and no config.json at its model path "
                       f"{model_path!r} names max_position_embeddings)")
    if not kv_bytes:
        missing.append(f"the KV bytes per token ({source}'s /server_info has no "
                       "pdd.kv_bytes_per_token, and no config.json at its model path "
                       f"{model_path!r} gives layers, KV heads, head dim and dtype); set "
                       "--kv-bytes-per-token")
    if missing:
        raise ModelUnknown("refusing to start: could not learn " + "; nor ".join(missing))
    return ModelInfo(
        model_path=model_path,
        served_model_name=model_info.get("served_model_name") or model_path,
        context_length=int(context),
        tokenizer=tokenizer,
        kv_bytes_per_token=float(kv_bytes),
        estimate=estimate_for(tokenizer),
    )


def estimate_for(tokenizer: Any) -> TokenEstimate:
    """The estimate's start: the tokens the tokenizer adds to any text, and a sample's tokens
    per byte."""
    specials = len(tokenizer.encode(""))
    sample = len(tokenizer.encode(_SAMPLE_TEXT)) - specials
    return TokenEstimate(max(sample, 1) / len(_SAMPLE_TEXT.encode()), specials)
