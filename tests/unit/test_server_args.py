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


def test_transfer_engine_loads_in_this_environment():
    from pdd_sglang.server_args import check_transfer_engine

    check_transfer_engine()
