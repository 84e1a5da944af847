"""The router in front of real SGLang servers that serve TLS and take SGLang's --api-key: it
reaches them over https with the test's CA bundle and a client certificate, serves TLS itself,
refuses a client without its key before any server sees the request, and without the CA bundle
reaches no server (a refusal at start). A prefill and a main of their own (P->MD), with
certificates made in the test (``cryptography``)."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

import pytest

from pdd_sglang.dev.testing.cluster import TEST_ROUTER_KEY, Cluster, SGLangServer, bearer, \
    free_port
from pdd_sglang.dev.testing.tiny_model import ensure_tiny_model
from pdd_sglang.dev.testing.tls import make_pki
from pdd_sglang.dev.testing.wan_cluster import RouterProcess

BODY = {"input_ids": list(range(10, 40)), "sampling_params": {"max_new_tokens": 4,
                                                            "temperature": 0.0}}


@pytest.fixture(scope="module")
def tls_pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("tls")
    pki = make_pki(base / "pki")
    tls = ("--ssl-certfile", pki.server.certfile, "--ssl-keyfile", pki.server.keyfile,
           "--ssl-ca-certs", pki.ca_file)
    transport = ("--disaggregation-transfer-backend", "mooncake_tcp")
    bootstrap_port = free_port()
    model = ensure_tiny_model()
    common = dict(max_total_tokens=4000, fork_children=True, ca_file=pki.ca_file)
    cluster = Cluster([
        SGLangServer("prefill", model, base, extra_args=(
            "--pdd-role", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port),
            *transport, *tls), **common),
        SGLangServer("main", model, base, extra_args=("--pdd-role", "main", *transport, *tls),
                     **common),
    ])
    with cluster:
        yield cluster, pki, bootstrap_port, base


def _router(cluster, pki, bootstrap_port, log, *extra) -> RouterProcess:
    return RouterProcess(log, [
        "--prefill", cluster["prefill"].url, str(bootstrap_port), "--main", cluster["main"].url,
        "--ssl-certfile", pki.server.certfile, "--ssl-keyfile", pki.server.keyfile,
        "--health-interval-s", "1", *extra], ca_file=pki.ca_file)


def _post(router: RouterProcess, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(router.url + "/generate", data=json.dumps(BODY).encode(),
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=300, context=router.context) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read())


def test_the_router_reaches_keyed_tls_servers_with_a_ca_bundle_and_a_client_cert(tls_pair):
    cluster, pki, bootstrap_port, base = tls_pair
    assert cluster["main"].url.startswith("https://")
    router = _router(cluster, pki, bootstrap_port, base / "router.log",
                     "--server-ssl-ca-certs", pki.ca_file,
                     "--server-ssl-certfile", pki.client.certfile,
                     "--server-ssl-keyfile", pki.client.keyfile)
    router.start()
    try:
        assert router.url.startswith("https://")
        ledger = len(cluster["prefill"].pdd_state()["transfers"]["by_request"])
        status, answer = _post(router, {})
        assert status == 401 and answer == {"error": "Unauthorized"}
        assert len(cluster["prefill"].pdd_state()["transfers"]["by_request"]) == ledger
        status, answer = _post(router, bearer(TEST_ROUTER_KEY))
        assert status == 200 and len(answer["output_ids"]) == 4, answer
        assert answer["meta_info"]["pdd"]["main"] == cluster["main"].url
        # A client that does not trust the CA does not get through to the router.
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(router.url + "/health", timeout=30,
                                   context=ssl.create_default_context())
    finally:
        router.stop()
    for name in ("prefill", "main"):
        pool = cluster[name].wait_idle()
        assert pool["in_use_tokens"] == 0 and pool["locked_tokens"] == 0, (name, pool)


def test_without_the_ca_bundle_the_router_reaches_no_server_and_says_so(tls_pair):
    cluster, pki, bootstrap_port, base = tls_pair
    router = _router(cluster, pki, bootstrap_port, base / "router-no-ca.log",
                     "--startup-timeout-s", "3")
    with pytest.raises(RuntimeError, match="no prefill server answered"):
        router.start(timeout_s=120)
    router.stop()
