"""Shared clusters of real SGLang servers on the tiny model (CPU profile).

Servers start once per module that asks for them and stop on every exit path; their logs stay in
pytest's temporary directory (the last runs are kept), and a failing start prints the log tail.
"""

from __future__ import annotations

import pytest

from pdd_sglang.testing.cluster import RELAY_CPU_ARGS, Cluster, SGLangServer, free_port
from pdd_sglang.testing.tiny_model import TinyModelSpec, ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model():
    spec = TinyModelSpec()
    return spec, ensure_tiny_model(spec)


@pytest.fixture(scope="module")
def pd_pair(tiny_model, tmp_path_factory):
    """A PDD prefill and a PDD main, over Mooncake TCP, with main's decode radix cache."""
    _, model_path = tiny_model
    log_dir = tmp_path_factory.mktemp("pd-pair-logs")
    bootstrap_port = free_port()
    transport = ("--disaggregation-transfer-backend", "mooncake_tcp")
    prefill = SGLangServer(
        "prefill", model_path, log_dir,
        extra_args=("--pdd-role", "prefill", "--disaggregation-bootstrap-port",
                    str(bootstrap_port), *transport),
    )
    main = SGLangServer("main", model_path, log_dir, extra_args=("--pdd-role", "main", *transport))
    with Cluster([prefill, main]) as cluster:
        cluster.bootstrap_port = bootstrap_port
        cluster.log_dir = log_dir
        yield cluster


@pytest.fixture(scope="module")
def three_roles(tiny_model, tmp_path_factory):
    """PDD prefill, relay and main on one machine (no WAN emulation), over Mooncake TCP."""
    _, model_path = tiny_model
    log_dir = tmp_path_factory.mktemp("three-roles-logs")
    bootstrap_port = free_port()
    transport = ("--disaggregation-transfer-backend", "mooncake_tcp")
    servers = [
        SGLangServer("prefill", model_path, log_dir, extra_args=(
            "--pdd-role", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port),
            *transport)),
        SGLangServer("relay", model_path, log_dir, extra_args=(
            "--pdd-role", "relay", *transport, *RELAY_CPU_ARGS)),
        SGLangServer("main", model_path, log_dir, extra_args=("--pdd-role", "main", *transport)),
    ]
    with Cluster(servers) as cluster:
        cluster.bootstrap_port = bootstrap_port
        cluster.log_dir = log_dir
        yield cluster
