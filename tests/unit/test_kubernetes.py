"""deploy/kubernetes/ agrees with the code: every manifest parses; each server runs the role its
file names with flags that exist, on the README's ports (HTTP, bootstrap, control) as its
container declares them; probes ask /ready (readiness) and /health (liveness), routes both the
router and SGLang leave open without a key; the router's arguments parse with its own parser,
point at the Services of its cluster, and its keys come from a Secret under the names the router
reads; every Secret, key and CURVE file a pod names exists; every document validates, strictly
(no field the API does not know), against the Kubernetes API's own schemas, offline
(kubernetes-validate carries them)."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest
import yaml
from sglang.srt.utils.auth import AuthLevel, decide_request_auth

from pdd_sglang.router.config import (DEFAULT_BOOTSTRAP_PORT, RouterConfig, declared_settings,
                                      parse_args)
from pdd_sglang.server_args import DEFAULT_CONTROL_PORT, PddArgs

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
CLUSTERS = sorted(p for p in DEPLOY.iterdir() if p.is_dir())
HTTP_PORT = RouterConfig.__dataclass_fields__["port"].default  # the README's 30000
PDD_FLAGS = {"--" + f.name.replace("_", "-") for f in msgspec.structs.fields(PddArgs)}
ROUTER_ENV = {s.flag.env for s in declared_settings() if s.flag.env}


def documents(cluster: Path) -> list[dict]:
    return [doc for path in sorted(cluster.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def of_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(docs: list[dict]):
    for deployment in of_kind(docs, "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        for container in pod["containers"]:
            yield deployment, pod, container


def option(args: list[str], flag: str):
    return args[args.index(flag) + 1] if flag in args else None


def ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def expanded(args: list[str], env: dict) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion of a container's arguments."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


@pytest.fixture(params=CLUSTERS, ids=lambda p: p.name)
def cluster(request):
    return documents(request.param)


def test_two_clusters_prefill_and_relay_and_the_router_in_one_main_in_the_other():
    roles = {c.name: {d["metadata"]["labels"]["role"]
                      for d in of_kind(documents(c), "Deployment").values()} for c in CLUSTERS}
    assert sorted(roles.values(), key=len) == [{"main"}, {"prefill", "relay", "router"}]


# The oldest Kubernetes release the manifests are written for (apps/v1, the probes' fields).
KUBERNETES_VERSION = "1.29"


def test_every_document_validates_against_the_kubernetes_schemas_offline(cluster):
    import kubernetes_validate

    for doc in cluster:
        # Raises kubernetes_validate.ValidationError naming the field and the document.
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_schema_check_refuses_a_field_kubernetes_does_not_know(cluster):
    import kubernetes_validate

    deployment = next(iter(of_kind(cluster, "Deployment").values()))
    bad = {**deployment, "spec": {**deployment["spec"], "replicaz": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_every_document_names_its_kind_and_name(cluster):
    for doc in cluster:
        assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"]


def test_servers_run_their_role_with_pdd_flags_that_exist_on_the_readme_s_ports(cluster):
    for deployment, pod, container in containers(cluster):
        args, role = container["args"], deployment["metadata"]["labels"]["role"]
        if role == "router":
            continue
        assert container["command"][-1] == "sglang.launch_server"
        assert option(args, "--pdd-role") == role
        assert {a for a in args if a.startswith("--pdd-")} <= PDD_FLAGS
        declared = ports(container)
        assert int(option(args, "--port")) == declared["http"] == HTTP_PORT
        if role == "prefill":
            assert int(option(args, "--disaggregation-bootstrap-port")) == declared[
                "bootstrap"] == DEFAULT_BOOTSTRAP_PORT
        if role == "relay":
            assert int(option(args, "--pdd-control-port")) == declared["control"] == \
                DEFAULT_CONTROL_PORT
        # Peers in the other datacenter dial the ports SGLang and Mooncake pick at start.
        assert pod["hostNetwork"] and option(args, "--pdd-advertise-host") == "$(HOST_IP)"
        assert option(args, "--api-key") == "$(PDD_SERVER_API_KEY)"


def test_probes_ask_ready_and_health_which_need_no_key(cluster):
    for _, _, container in containers(cluster):
        ready, alive = container["readinessProbe"]["httpGet"], container["livenessProbe"]["httpGet"]
        assert (ready["path"], alive["path"]) == ("/ready", "/health")
        assert ready["port"] == alive["port"] == "http" and "http" in ports(container)
        for path in ("/ready", "/health"):  # the router and SGLang decide alike
            assert decide_request_auth(method="GET", path=path, authorization_header=None,
                                       api_key="k", admin_api_key="a",
                                       auth_level=AuthLevel.NORMAL).allowed


def test_the_router_s_routes_include_the_probes():
    from pdd_sglang.router.app import build_app
    from pdd_sglang.router.config import PrefillEndpoint
    from pdd_sglang.router.service import RouterService
    app = build_app(RouterService(RouterConfig(prefills=(PrefillEndpoint("http://p"),),
                                               mains=("http://m",))))
    paths = {r.resource.canonical for r in app.router.routes() if r.method == "GET"}
    assert {"/ready", "/health", "/metrics"} <= paths


def test_the_router_s_arguments_parse_and_point_at_its_cluster_s_services():
    docs = documents(DEPLOY / "cluster-a")
    settings = of_kind(docs, "ConfigMap")["pdd-settings"]["data"]
    services = of_kind(docs, "Service")
    [(_, _, router)] = [c for c in containers(docs) if c[2]["name"] == "router"]
    config = parse_args(expanded(router["args"], settings))
    assert config.port == ports(router)["http"] == HTTP_PORT and config.host == "0.0.0.0"
    for url, role in [(config.prefills[0].url, "prefill"), (config.relays[0], "relay")]:
        service = services[f"pdd-{role}"]
        assert url == f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert config.prefills[0].bootstrap_port == DEFAULT_BOOTSTRAP_PORT
    assert config.mains == (settings["MAIN_URL"],)
    # Its keys from the environment, a Secret holding every one the router reads; none on its
    # command line.
    [secret_ref] = [e["secretRef"]["name"] for e in router["envFrom"] if "secretRef" in e]
    secret = of_kind(docs, "Secret")[secret_ref]["stringData"]
    assert ROUTER_ENV <= set(secret)
    assert not [a for a in router["args"] if "key" in a.lower()]
    assert services["pdd-router"]["spec"]["ports"][0]["targetPort"] == "http"


def test_every_secret_key_and_curve_file_a_pod_names_exists(cluster):
    secrets = {name: set(s["stringData"]) for name, s in of_kind(cluster, "Secret").items()}
    settings = of_kind(cluster, "ConfigMap")
    for deployment, pod, container in containers(cluster):
        for ref in container.get("envFrom", []):
            if "secretRef" in ref:
                assert ref["secretRef"]["name"] in secrets
            else:
                assert ref["configMapRef"]["name"] in settings
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                assert ref["key"] in secrets[ref["name"]] and env["name"] == ref["key"]
                assert env["name"] in ROUTER_ENV  # one name per key, the router's
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}
        for flag in ("--pdd-control-keypair", "--pdd-control-relay-key",
                     "--pdd-control-authorized-keys"):
            path = option(container["args"], flag)
            if path is None:
                continue
            directory, _, name = path.rpartition("/")
            if flag == "--pdd-control-authorized-keys":  # a directory of public keys
                directory, name = path, None
            secret = mounts[directory]["secret"]["secretName"]
            assert name is None or name in secrets[secret], (flag, path)
        services = [s for s in of_kind(cluster, "Service").values()
                    if s["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]]
        assert services and all(p["targetPort"] in ports(container)
                                for s in services for p in s["spec"]["ports"])


def test_the_dockerfile_installs_through_setup_env_and_says_it_is_not_built_here():
    text = (DEPLOY / "Dockerfile").read_text()
    assert "RUN scripts/setup_env.sh gpu" in text and "NOT BUILT HERE" in text
    exposed = {int(p) for p in re.search(r"EXPOSE ([\d ]+)", text).group(1).split()}
    assert exposed == {HTTP_PORT, DEFAULT_BOOTSTRAP_PORT, DEFAULT_CONTROL_PORT}
