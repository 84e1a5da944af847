import os

import pytest

from pdd_sglang.server_args import PddConfigError, _decide


def decide(role, mode="null", backend="mooncake_tcp", radix=False):
    return _decide(
        role=role, disaggregation_mode=mode, transfer_backend=backend, decode_radix_cache=radix
    )


@pytest.mark.parametrize(
    "role, expected",
    [
        ("prefill", {"disaggregation_mode": "prefill"}),
        ("relay", {"disaggregation_mode": "decode"}),
        ("main", {"disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": True}),
    ],
)
def test_role_implies_mode_and_defaults(role, expected):
    assert decide(role) == expected


def test_explicit_matching_mode_is_accepted():
    assert decide("prefill", mode="prefill") == {}
    assert decide("main", mode="decode", radix=True) == {}


@pytest.mark.parametrize("role, mode", [("prefill", "decode"), ("relay", "prefill"), ("main", "prefill")])
def test_contradictory_mode_names_both_flags(role, mode):
    with pytest.raises(PddConfigError) as err:
        decide(role, mode=mode)
    assert f"--pdd-role {role}" in str(err.value)
    assert f"--disaggregation-mode {mode}" in str(err.value)


def test_relay_refuses_decode_radix_cache():
    with pytest.raises(PddConfigError, match="--disaggregation-decode-enable-radix-cache"):
        decide("relay", radix=True)


def test_non_mooncake_backend_refused():
    with pytest.raises(PddConfigError, match="--disaggregation-transfer-backend nixl"):
        decide("main", backend="nixl")


def test_unknown_role_refused():
    with pytest.raises(PddConfigError, match="unknown"):
        decide("router")


def test_missing_libibverbs_gets_one_clear_message():
    from pdd_sglang.server_args import check_transfer_engine

    def broken():
        raise ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")

    with pytest.raises(PddConfigError, match="install the Debian package libibverbs1"):
        check_transfer_engine(broken)


def test_missing_mooncake_gets_one_clear_message():
    from pdd_sglang.server_args import check_transfer_engine

    def absent():
        raise ModuleNotFoundError("No module named 'mooncake'")

    with pytest.raises(PddConfigError, match="could not be imported"):
        check_transfer_engine(absent)


def test_transfer_engine_loads_in_this_environment_and_only_in_a_child():
    import subprocess
    import sys

    # A fresh interpreter: this one may hold the engine from other tests. A launcher that loaded
    # it would carry Mooncake's Go runtime (its threads) into the fork of SGLang's children.
    proc = subprocess.run([sys.executable, "-c", (
        "import sys; from pdd_sglang.server_args import check_transfer_engine; "
        "check_transfer_engine(); assert 'mooncake.engine' not in sys.modules, 'loaded here'")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_an_engine_that_fails_in_the_child_is_reported_with_its_error(monkeypatch):
    from pdd_sglang import server_args

    monkeypatch.setattr(server_args.sys, "executable", "/bin/false")
    with pytest.raises(PddConfigError, match="could not be imported"):
        server_args.check_transfer_engine()


@pytest.mark.parametrize("role, expected", [("prefill", False), ("relay", True), ("main", True)])
def test_relay_and_main_leave_the_overlap_loop(role, expected):
    decisions = _decide(role=role, disaggregation_mode="null", transfer_backend="mooncake_tcp",
                        decode_radix_cache=False, disable_overlap_schedule=False)
    assert decisions.get("disable_overlap_schedule", False) is expected


def handoff_flags(**overrides):
    from types import SimpleNamespace

    values = dict(pdd_role="relay", pdd_control_port=0, pdd_catch_up_threshold=64,
                  pdd_catch_up_chunk=64, pdd_relay_load_watermark=0.7, pdd_handoff_timeout=30.0,
                  pdd_control_keypair=None,
                  pdd_control_authorized_keys=None, pdd_control_relay_key=None,
                  pdd_relay_bootstrap_timeout=5.0, pdd_main_bootstrap_timeout=30.0,
                  pdd_wan_bandwidth_gbps=10.0, pdd_wan_rtt_ms=20.0, pdd_wan_window_mb=0.0,
                  pdd_wan_cache_only_backlog_s=30.0, pdd_wan_staging_mb=0.0,
                  pdd_wan_kv_codec="auto", pdd_enable_kv_digest=False)
    values.update(overrides)
    return SimpleNamespace(**values)


@pytest.mark.parametrize("overrides, flag", [
    ({"pdd_control_port": 70000}, "--pdd-control-port"),
    ({"pdd_catch_up_chunk": 0}, "--pdd-catch-up-chunk"),
    ({"pdd_catch_up_threshold": -1}, "--pdd-catch-up-threshold"),
    ({"pdd_relay_load_watermark": -0.1}, "--pdd-relay-load-watermark"),
    ({"pdd_handoff_timeout": 0}, "--pdd-handoff-timeout"),
    ({"pdd_main_bootstrap_timeout": 0}, "--pdd-main-bootstrap-timeout"),
    ({"pdd_relay_bootstrap_timeout": -1}, "--pdd-relay-bootstrap-timeout"),
    ({"pdd_wan_bandwidth_gbps": 0}, "--pdd-wan-bandwidth-gbps"),
    ({"pdd_wan_rtt_ms": -1}, "--pdd-wan-rtt-ms"),
    ({"pdd_wan_window_mb": -1}, "--pdd-wan-window-mb"),
    ({"pdd_wan_cache_only_backlog_s": -1}, "--pdd-wan-cache-only-backlog-s"),
    ({"pdd_wan_staging_mb": -1}, "--pdd-wan-staging-mb"),
    ({"pdd_wan_kv_codec": "fp8", "pdd_enable_kv_digest": True},
     "--pdd-wan-kv-codec fp8 with --pdd-enable-kv-digest: FP8 is lossy"),
    ({"pdd_control_keypair": "/k/relay.key_secret"}, "--pdd-control-authorized-keys"),
    ({"pdd_role": "main", "pdd_control_keypair": "/k/main.key_secret"}, "--pdd-control-relay-key"),
])
def test_bad_handoff_flags_are_refused_by_name(overrides, flag):
    from pdd_sglang.server_args import _check_handoff_flags

    with pytest.raises(PddConfigError, match=flag):
        _check_handoff_flags(handoff_flags(**overrides))


def test_default_handoff_flags_pass():
    from pdd_sglang.server_args import _check_handoff_flags

    _check_handoff_flags(handoff_flags())
    # lossless is bit-exact: the digest holds with it; fp8 alone is the operator's choice
    _check_handoff_flags(handoff_flags(pdd_wan_kv_codec="lossless", pdd_enable_kv_digest=True))
    _check_handoff_flags(handoff_flags(pdd_wan_kv_codec="fp8"))


@pytest.mark.parametrize("setting, message", [
    ({"pp_size": 2}, "--pp-size 2: PDD does not support pipeline parallelism"),
    ({"dp_size": 2}, "--dp-size 2: PDD does not support data parallelism inside one server"),
    ({"dp_size": 2, "enable_dp_attention": True},
     "--enable-dp-attention: PDD does not support DP attention"),
    ({"enable_dp_attention": True}, "--enable-dp-attention: PDD does not support DP attention"),
    ({"staging_buffer": True}, "SGLANG_DISAGG_STAGING_BUFFER=1"),
])
@pytest.mark.parametrize("role", ["prefill", "relay", "main"])
def test_unsupported_parallelism_is_refused_one_message_each(role, setting, message):
    from pdd_sglang.server_args import check_parallelism

    with pytest.raises(PddConfigError) as err:
        check_parallelism(role, **setting)
    assert str(err.value).startswith(f"--pdd-role {role} with {message}")


def test_the_default_parallelism_is_accepted():
    from pdd_sglang.server_args import check_parallelism

    check_parallelism("relay", pp_size=1, enable_dp_attention=False, staging_buffer=False)


def test_sglangs_own_argument_resolution_takes_tp_2_with_the_kv_digest():
    """Every role runs at TP > 1 (issue 23), with the KV digest too (issue 37: each rank hashes
    its heads, combined across ranks); SGLang's resolution step (patch 0001) runs the checks."""
    from sglang_resolution import outcomes

    accepted = outcomes()["tp2_kv_digest"]
    assert accepted["ok"], accepted


def test_a_pdd_decode_holds_aborted_pages_as_long_as_a_wan_write_may_land(monkeypatch):
    """Issue 34's hazard: main freed an aborted room's pages after SGLang's 30 s deferred-release
    timeout, while a WAN write to them may run 2 x --pdd-wan-transfer-timeout (120 s) before the
    prefill acks; a late block landed in pages given to the next request."""
    from pdd_sglang.server_args import (DEFERRED_RELEASE_ENV, PddConfigError,
                                        hold_aborted_pages_past_wan_writes)

    monkeypatch.delenv(DEFERRED_RELEASE_ENV, raising=False)
    hold_aborted_pages_past_wan_writes(120)
    assert float(os.environ[DEFERRED_RELEASE_ENV]) >= 2 * 120
    monkeypatch.setenv(DEFERRED_RELEASE_ENV, "30")
    with pytest.raises(PddConfigError, match="--pdd-wan-transfer-timeout"):
        hold_aborted_pages_past_wan_writes(120)
    monkeypatch.setenv(DEFERRED_RELEASE_ENV, "300")
    hold_aborted_pages_past_wan_writes(120)
    assert os.environ[DEFERRED_RELEASE_ENV] == "300"  # the operator's longer hold stays
