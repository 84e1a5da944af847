"""The tiny test models' specs: cache keys, and the head-dim override of the KV-realistic ones."""

from __future__ import annotations

import json

from pdd_sglang.dev.testing.tiny_model import (KV_8B_MODEL, KV_80_LAYER_MODEL, WAN_DEMO_MODEL,
                                               TinyModelSpec, ensure_tiny_model)


def test_models_made_without_the_override_keep_their_cache_keys():
    # The keys of the models every cache holds (tests, demo): a new spec field must not rebuild them.
    assert TinyModelSpec().digest() == "a34b6461c6ee"
    assert WAN_DEMO_MODEL.digest() == "d60210c57e83"
    assert TinyModelSpec(head_dim_override=None).digest() == TinyModelSpec().digest()


def test_the_override_sets_the_head_dim_and_its_own_key():
    computed = TinyModelSpec()
    assert computed.head_dim == computed.hidden_size // computed.num_attention_heads == 16
    wide = TinyModelSpec(head_dim_override=64)
    assert wide.head_dim == 64
    assert wide.kv_bytes_per_token == 2 * 2 * 2 * 64 * 4
    assert wide.digest() != computed.digest()
    # Overriding with the computed value is still a spec of its own: the config differs.
    assert TinyModelSpec(head_dim_override=16).digest() != computed.digest()


def test_kv_realistic_models_have_llama_3_kv_geometry():
    for spec, layers in ((KV_8B_MODEL, 32), (KV_80_LAYER_MODEL, 80)):
        assert (spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim) == (layers, 8, 128)
        # float32: 2 (K, V) x layers x 8 heads x 128 x 4 B
        assert spec.kv_bytes_per_token == layers * 8192
    assert KV_8B_MODEL.kv_bytes_per_token == 256 << 10


def test_the_written_config_carries_the_overridden_head_dim(tmp_path):
    spec = TinyModelSpec(hidden_size=32, intermediate_size=32, num_attention_heads=2,
                         num_key_value_heads=1, head_dim_override=24)
    path = ensure_tiny_model(spec, tmp_path)
    config = json.loads((path / "config.json").read_text())
    assert config["head_dim"] == 24 and config["hidden_size"] == 32
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        k_proj = weights.get_tensor("model.layers.0.self_attn.k_proj.weight")
        q_proj = weights.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert tuple(k_proj.shape) == (24, 32) and tuple(q_proj.shape) == (48, 32)
