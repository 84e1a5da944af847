"""``/server_info``'s PDD block: diagnostics' own part, and each role's part through the providers
the role registers (diagnostics imports no role)."""

from types import SimpleNamespace

import pytest
import torch

import pdd_sglang.hooks as hooks
from pdd_sglang.diagnostics import server_info


def _model_config(**fields):
    """SGLang's ModelConfig as far as ``kv_bytes_per_token`` reads it: a Llama-like MHA."""
    defaults = dict(num_attention_layers=4, num_hidden_layers=4, head_dim=64, v_head_dim=64,
                    kv_lora_rank=None, context_len=4096, get_total_num_kv_heads=lambda: 2)
    return SimpleNamespace(**{**defaults, **fields})


def _scheduler(kv_mgr, handoff=None, model_config=None, kv_dtype=torch.bfloat16):
    """SGLang's scheduler as far as ``add_pdd_state`` reads it: an idle pool of 100 tokens."""
    count = lambda n: (lambda: n)  # noqa: E731
    pool = SimpleNamespace(dtype=kv_dtype)
    return SimpleNamespace(
        model_config=model_config or _model_config(),
        tree_cache=SimpleNamespace(evictable_size=count(0), protected_size=count(0)),
        token_to_kv_pool_allocator=SimpleNamespace(available_size=count(100),
                                                   get_kvcache=lambda: pool),
        req_to_token_pool=SimpleNamespace(available_size=count(8)),
        max_total_num_tokens=100,
        disagg_prefill_bootstrap_queue=SimpleNamespace(kv_manager=kv_mgr),
        _pdd_handoff=handoff)  # decode.handoff_for's cache: built already (None: no handoff)


def _kv_mgr(fanout=None):
    return SimpleNamespace(engine=SimpleNamespace(get_session_id=lambda: "10.0.0.11:1234"),
                           pdd_fanout=fanout)


@pytest.fixture
def pdd_server(monkeypatch):
    monkeypatch.setattr(hooks, "_role", "prefill")


def test_a_prefill_reports_its_ledger_line_and_fanout_through_its_providers(pdd_server):
    line = SimpleNamespace(snapshot=lambda: {"md:1": {"bytes_ahead": 5}})
    fanout = SimpleNamespace(wan_line=line, published={"mains_out": ["md:1"]})
    state = {}
    hooks.add_internal_state(_scheduler(_kv_mgr(fanout)), state)
    pdd = state["pdd"]
    assert pdd["pool"]["in_use_tokens"] == 0 and pdd["mooncake_session"] == "10.0.0.11:1234"
    assert set(pdd["transfers"]) >= {"by_destination", "by_request"}
    assert pdd["wan_line"] == {"md:1": {"bytes_ahead": 5}}
    assert pdd["fanout"] == {"mains_out": ["md:1"]} and "handoff" not in pdd


def test_a_decode_server_reports_its_handoff_and_no_fanout(pdd_server):
    handoff = SimpleNamespace(state=lambda: {"control_address": "tcp://10.0.0.12:8999"})
    state = {}
    hooks.add_internal_state(_scheduler(_kv_mgr(), handoff), state)
    pdd = state["pdd"]
    assert pdd["handoff"] == {"control_address": "tcp://10.0.0.12:8999"}
    assert pdd["wan_line"] is None and pdd["fanout"] is None


def test_a_role_cannot_take_over_diagnostics_own_keys():
    with pytest.raises(ValueError, match="pool"):
        server_info.register_state("pool", lambda scheduler, kv_mgr: {})


def test_the_model_s_kv_bytes_per_token_come_from_sglang_s_config_and_kv_dtype(pdd_server):
    """What the router places with (router/model.py): every layer's K and V over all KV heads
    at the pool's dtype; MLA's latent and rope parts; and the context length."""
    state = {}
    hooks.add_internal_state(_scheduler(_kv_mgr()), state)
    assert state["pdd"]["kv_bytes_per_token"] == 4 * 2 * (64 + 64) * 2
    assert state["pdd"]["context_length"] == 4096
    fp8 = _scheduler(_kv_mgr(), kv_dtype=torch.float8_e4m3fn)
    assert server_info.kv_bytes_per_token(fp8) == 4 * 2 * (64 + 64) * 1
    mla = _scheduler(_kv_mgr(), model_config=_model_config(
        num_attention_layers=61, kv_lora_rank=512, qk_rope_head_dim=64))
    assert server_info.kv_bytes_per_token(mla) == 61 * (512 + 64) * 2
