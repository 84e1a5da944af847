"""Addresses and ports an operator sets (issue 26, item 1): --pdd-advertise-host,
--pdd-wan-hostname, the fixed default control port; bad values refused by name."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from pdd_sglang.server_args import (DEFAULT_CONTROL_PORT, PddArgs, PddConfigError,
                                    check_address_flags)


def test_the_control_port_has_a_fixed_documented_default():
    assert PddArgs().pdd_control_port == DEFAULT_CONTROL_PORT == 8999
    assert PddArgs().pdd_advertise_host is None and PddArgs().pdd_wan_hostname is None


@pytest.mark.parametrize("flag", ["advertise", "wan"])
@pytest.mark.parametrize("value, message", [
    ("0.0.0.0", "a wildcard is what a server binds"),
    ("::", "a wildcard is what a server binds"),
    ("", "must be a host name or IP address"),
    ("my host", "must be a host name or IP address"),
    ("10.0.0.1:8999", "give the host alone"),
    ("tcp://10.0.0.1", "give the host alone"),
    ("no-such-host.invalid", "does not resolve on this host"),
])
def test_bad_addresses_are_refused_by_flag(flag, value, message):
    name = "--pdd-advertise-host" if flag == "advertise" else "--pdd-wan-hostname"
    args = (value, None) if flag == "advertise" else (None, value)
    with pytest.raises(PddConfigError) as err:
        check_address_flags(*args)
    assert str(err.value).startswith(name) and message in str(err.value)


@pytest.mark.parametrize("value", ["10.1.2.3", "localhost", "::1", "fe80::1"])
def test_good_addresses_pass(value):
    check_address_flags(value, value)
    check_address_flags(None, None)


def test_the_relay_advertises_its_advertise_host_when_bound_to_the_wildcard(monkeypatch):
    from pdd_sglang.decode.handoff_channel import advertised_host, relay_loop, zmq_address

    monkeypatch.delenv("SGLANG_HOST_IP", raising=False)
    assert advertised_host("0.0.0.0", "10.9.8.7") == "10.9.8.7"
    assert advertised_host("10.0.0.2", None) == "10.0.0.2"
    assert advertised_host("0.0.0.0", None) == socket.gethostbyname(socket.gethostname())
    monkeypatch.setenv("SGLANG_HOST_IP", "10.0.0.3")
    assert advertised_host("0.0.0.0", None) == "10.0.0.3"
    assert zmq_address("::1", 5) == "tcp://[::1]:5"
    args = SimpleNamespace(host="0.0.0.0", pdd_control_port=0, pdd_advertise_host="10.9.8.7",
                           pdd_control_keypair=None, pdd_control_relay_key=None,
                           pdd_control_authorized_keys=None)
    loop = relay_loop(args)
    try:
        host, port = loop.address[len("tcp://"):].rsplit(":", 1)
        assert host == "10.9.8.7" and int(port) > 0
    finally:
        loop.close()


def test_the_wan_engine_host_prefers_its_own_flag_then_the_advertised_one():
    from pdd_sglang.prefill.wan_engine import wan_hostname

    kv_mgr = SimpleNamespace(engine=SimpleNamespace(hostname="10.0.0.5"), local_ip="10.0.0.6")
    assert wan_hostname(kv_mgr) == "10.0.0.5"
    assert wan_hostname(kv_mgr, None, "a.example") == "a.example"
    assert wan_hostname(kv_mgr, "wan0.example", "a.example") == "wan0.example"


def test_the_advertise_host_becomes_sglangs_host_ip_when_unset():
    """SGLang's own resolution step (patch 0001) runs the checks and sets SGLANG_HOST_IP for the
    scheduler it then starts."""
    from sglang_resolution import outcomes

    good, wildcard = outcomes()["advertise_host"], outcomes()["advertise_wildcard"]
    assert good["ok"] and good["host_ip"] == "127.0.0.1", good
    assert not wildcard["ok"] and "--pdd-advertise-host 0.0.0.0: a wildcard" in wildcard["error"]
