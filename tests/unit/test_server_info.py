"""``/server_info``'s PDD block: diagnostics' own part, and each role's part through the providers
the role registers (diagnostics imports no role)."""

from types import SimpleNamespace

import pytest

import pdd_sglang.hooks as hooks
from pdd_sglang.diagnostics import server_info


def _scheduler(kv_mgr, handoff=None):
    """SGLang's scheduler as far as ``add_pdd_state`` reads it: an idle pool of 100 tokens."""
    count = lambda n: (lambda: n)  # noqa: E731
    return SimpleNamespace(
        tree_cache=SimpleNamespace(evictable_size=count(0), protected_size=count(0)),
        token_to_kv_pool_allocator=SimpleNamespace(available_size=count(100)),
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
