"""Static checks of the Kubernetes manifests (deploy/k8s): valid against the Kubernetes schemas, and the same stack
as docker-compose.yml.

No cluster is needed. The kustomization is rendered by a small loader (the kustomize features the manifests use:
resources, namespace, a ConfigMap generator without a name hash); where `kubectl` is installed, `kubectl
kustomize` renders it too and must agree. Every resource is validated, strictly (no unknown field), against the
schemas `kubernetes-validate` bundles, offline. The secrets are the ones `deploy/secrets/generate.py` writes,
generated afresh for the cluster's host names.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from wsgiref.simple_server import make_server

import kubernetes_validate  # type: ignore[import-untyped]  # ships no type information
import pytest
import yaml
from prometheus_client import CollectorRegistry, Gauge
from test_compose import parse_nats_conf

from lanes_cli.bootstrap import SERVICES
from lanes_runtime.metrics import probes_and_metrics
from lanes_runtime.settings import ENV_VARS

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
COMPOSE_FILE = ROOT / "docker-compose.yml"
COMPOSE_NATS_CONF = ROOT / "deploy" / "nats" / "nats.conf"
KUBERNETES_VERSION = "1.37.0"
NAMESPACE = "lanes"
NATS_REPLICAS = 3
CLUSTER_SCOPED = frozenset({"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"})
OPERATOR_SECRETS = {"lanes-postgres", "lanes-audit-key", "lanes-console-token"}
"""Secrets the operator makes by hand (a password, optional keys); every other comes from generate.py."""
HTTP_SERVICES = {"router": "LANES_ROUTER_PORT", "console": "LANES_CONSOLE_PORT"}
KUBECTL = shutil.which("kubectl")

# --- Rendering ------------------------------------------------------------------------------------------------------


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def load_kustomization(directory: Path) -> list[dict[str, Any]]:
    """The resources a kustomization builds, for the features these manifests use (anything else is refused)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "namespace", "resources", "configMapGenerator", "generatorOptions"}
    assert set(kustomization) <= known, f"{directory}: the loader does not know {set(kustomization) - known}"
    resources: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        assert path.is_relative_to(K8S), f"{entry}: outside deploy/k8s"
        resources.extend(load_kustomization(path) if path.is_dir() else _documents(path))
    generators = kustomization.get("configMapGenerator", [])
    if generators:
        assert kustomization.get("generatorOptions", {}).get("disableNameSuffixHash") is True, (
            "the loader renders generated names without kustomize's hash suffix"
        )
    for generator in generators:
        assert set(generator) <= {"name", "files"}, generator
        data = {}
        for file in generator["files"]:
            key, _, source = file.partition("=")
            data[key if source else Path(key).name] = (directory / (source or key)).read_text()
        resources.append(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data}
        )
    if "namespace" in kustomization:
        for resource in resources:
            if resource["kind"] not in CLUSTER_SCOPED:
                resource["metadata"]["namespace"] = kustomization["namespace"]
    return resources


def _key(resource: dict[str, Any]) -> tuple[str, str]:
    return resource["kind"], resource["metadata"]["name"]


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    resources = load_kustomization(K8S)
    keys = [_key(r) for r in resources]
    assert len(keys) == len(set(keys)), "a resource is defined twice"
    return resources


@pytest.fixture(scope="module")
def by_kind(rendered: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    kinds: dict[str, dict[str, dict[str, Any]]] = {}
    for resource in rendered:
        kinds.setdefault(resource["kind"], {})[resource["metadata"]["name"]] = resource
    return kinds


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed: the loader alone renders")
def test_kubectl_kustomize_renders_what_the_loader_renders(rendered: list[dict[str, Any]]) -> None:
    assert KUBECTL is not None
    built = subprocess.run(
        [KUBECTL, "kustomize", str(K8S)], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    by_kubectl = {_key(doc): doc for doc in yaml.safe_load_all(built) if doc}
    assert by_kubectl == {_key(r): r for r in rendered}


# --- Against the Kubernetes schemas ---------------------------------------------------------------------------------


def test_every_resource_is_valid_against_the_kubernetes_schemas(rendered: list[dict[str, Any]]) -> None:
    assert rendered
    for resource in rendered:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)


def test_the_validation_is_strict_about_a_misspelt_field(by_kind: dict[str, dict[str, dict[str, Any]]]) -> None:
    deployment = yaml.safe_load(yaml.safe_dump(by_kind["Deployment"]["scheduler"]))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"tcpSocket": {"port": 9090}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_every_namespaced_resource_is_in_the_lanes_namespace(rendered: list[dict[str, Any]]) -> None:
    for resource in rendered:
        if resource["kind"] not in CLUSTER_SCOPED:
            assert resource["metadata"].get("namespace") == NAMESPACE, _key(resource)


# --- The same stack as docker-compose.yml ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose_services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    return services


def _compose_lanes(compose_services: dict[str, dict[str, Any]]) -> set[str]:
    """The long-running Lanes services of the compose file: built from the Dockerfile, not one-shot."""
    return {name for name, spec in compose_services.items() if "build" in spec and "entrypoint" not in spec}


def test_every_compose_service_has_a_deployment_and_every_deployment_a_compose_service(
    compose_services: dict[str, dict[str, Any]], by_kind: dict[str, dict[str, dict[str, Any]]]
) -> None:
    assert set(by_kind["Deployment"]) == _compose_lanes(compose_services)
    assert set(SERVICES) <= set(by_kind["Deployment"])


def test_the_servers_and_the_one_shot_are_there_too(
    compose_services: dict[str, dict[str, Any]], by_kind: dict[str, dict[str, dict[str, Any]]]
) -> None:
    images = {name: str(spec.get("image", "")).split(":")[0] for name, spec in compose_services.items()}
    nats_nodes = [name for name, image in images.items() if image == "nats"]
    assert by_kind["StatefulSet"]["nats"]["spec"]["replicas"] == len(nats_nodes) == NATS_REPLICAS
    assert {"postgres", "redis"} <= set(by_kind["StatefulSet"])
    one_shots = {name for name, spec in compose_services.items() if "entrypoint" in spec}
    assert set(by_kind["Job"]) == one_shots
    for server in ("postgres", "redis"):
        compose_image = compose_services[server]["image"]
        (container,) = by_kind["StatefulSet"][server]["spec"]["template"]["spec"]["containers"]
        assert container["image"] == compose_image
    (nats,) = by_kind["StatefulSet"]["nats"]["spec"]["template"]["spec"]["containers"]
    assert nats["image"] == compose_services[nats_nodes[0]]["image"]


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    found: dict[str, Any] = container
    return found


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container.get("env", [])}


def test_each_service_runs_its_own_image_with_requests_and_a_readiness_probe(
    by_kind: dict[str, dict[str, dict[str, Any]]],
) -> None:
    for name, deployment in by_kind["Deployment"].items():
        container = _container(deployment)
        assert container["image"].split(":")[0] == f"lanes-{name}", name
        requests = container["resources"]["requests"]
        assert requests.get("cpu"), name
        assert requests.get("memory"), name
        assert container["resources"]["limits"]["memory"], name
        assert "readinessProbe" in container, name
        assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001  # the image's user


def test_consumer_services_are_ready_when_their_consumers_are_and_expose_metrics(
    by_kind: dict[str, dict[str, dict[str, Any]]],
) -> None:
    consumers = {name for name in by_kind["Deployment"] if name not in HTTP_SERVICES}
    assert consumers == {*SERVICES, "audit"} - set(HTTP_SERVICES)
    for name in consumers:
        container = _container(by_kind["Deployment"][name])
        env = _env(container)
        port = int(env["LANES_METRICS_PORT"])
        assert env["LANES_METRICS_HOST"] == "0.0.0.0"  # noqa: S104 - scraped from outside the container
        assert {"name": "metrics", "containerPort": port} in container["ports"]
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        annotations = by_kind["Deployment"][name]["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(port)


def test_the_router_is_ready_from_its_readyz(by_kind: dict[str, dict[str, dict[str, Any]]]) -> None:
    container = _container(by_kind["Deployment"]["router"])
    port = int(_env(container)["LANES_ROUTER_PORT"])
    assert {"name": "http", "containerPort": port} in container["ports"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert by_kind["Service"]["router"]["spec"]["ports"][0]["port"] == port


@pytest.fixture
def metrics_server() -> Iterator[tuple[int, Gauge]]:
    """The services' own metrics port (`lanes_runtime.metrics`) with one registry's `lanes_consumer_ready`."""
    registry = CollectorRegistry()
    ready = Gauge(
        "lanes_consumer_ready", "1 when every server the consumer depends on answers", ["consumer"], registry=registry
    )
    server = make_server("127.0.0.1", 0, probes_and_metrics(registry))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_port, ready
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_readiness_probe_follows_the_consumers_ready_gauge(
    by_kind: dict[str, dict[str, dict[str, Any]]], metrics_server: tuple[int, Gauge]
) -> None:
    port, ready = metrics_server
    probe = _container(by_kind["Deployment"]["scheduler"])["readinessProbe"]["httpGet"]

    def status() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{probe['path']}", timeout=10) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as refused:
            return refused.code, refused.read().decode()

    assert status() == (503, "no consumer has started yet\n")
    ready.labels("scheduler").set(1)
    ready.labels("scheduler-nodes").set(0)
    assert status() == (503, "not ready: scheduler-nodes\n")  # one consumer waits on a server
    ready.labels("scheduler-nodes").set(1)
    assert status() == (200, "ready\n")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        assert b'lanes_consumer_ready{consumer="scheduler"} 1.0' in answer.read()


def test_services_set_only_variables_lanes_reads_and_reach_the_cluster_servers(
    by_kind: dict[str, dict[str, dict[str, Any]]],
) -> None:
    for name, deployment in by_kind["Deployment"].items():
        env = _env(_container(deployment))
        unknown = set(env) - set(ENV_VARS) - {"POSTGRES_PASSWORD"}  # only to build DATABASE_URL
        assert not unknown, f"{name}: sets {sorted(unknown)}, which Lanes does not read"
        assert env["LANES_STREAM_REPLICAS"] == str(NATS_REPLICAS)
        assert env["LANES_LOG_FORMAT"] == "json"
        database, redis = urlsplit(env["DATABASE_URL"]), urlsplit(env["REDIS_URL"])
        assert (database.hostname, database.port) == ("postgres", 5432)
        assert (redis.hostname, redis.port) == ("redis", 6379)
        assert env["POSTGRES_PASSWORD"] == {"secretKeyRef": {"name": "lanes-postgres", "key": "password"}}
        for host in ("postgres", "redis"):
            assert host in by_kind["Service"], f"no Service {host}"


# --- Credentials: each identity its own, from what generate.py writes -------------------------------------------------


def _nats_hosts(by_kind: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    statefulset = by_kind["StatefulSet"]["nats"]
    service = statefulset["spec"]["serviceName"]
    return [f"nats-{index}.{service}" for index in range(statefulset["spec"]["replicas"])]


@pytest.fixture(scope="module")
def secrets_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`deploy/secrets/generate.py --hosts nats-0.nats-headless,...` (as the README says), generated afresh."""
    out = tmp_path_factory.mktemp("k8s-secrets") / "out"
    hosts = ",".join(f"nats-{index}.nats-headless" for index in range(NATS_REPLICAS))
    generator = ROOT / "deploy" / "secrets" / "generate.py"
    subprocess.run([sys.executable, str(generator), str(out), "--hosts", hosts], check=True, timeout=120)
    return out


def _env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line)


def _workloads(by_kind: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    return {**by_kind["Deployment"], **by_kind["Job"]}


def test_each_workload_connects_as_its_own_identity_with_only_its_own_key(
    by_kind: dict[str, dict[str, dict[str, Any]]], secrets_out: Path
) -> None:
    identity_of = {"provision": "admin"}
    for name, workload in _workloads(by_kind).items():
        identity = identity_of.get(name, name)
        container = _container(workload)
        assert container["envFrom"] == [{"secretRef": {"name": f"lanes-{identity}"}}], name
        generated = _env_file(secrets_out / f"{identity}.env")  # what the Secret lanes-<identity> holds
        (mount,) = container["volumeMounts"]
        key_file = Path(generated["LANES_SIGNING_KEY_FILE"])
        assert Path(mount["mountPath"]) == key_file.parent, name
        assert Path(generated["SSL_CERT_FILE"]).parent == key_file.parent
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        sources = volumes[mount["name"]]["projected"]["sources"]
        files = {item["path"]: source["secret"]["name"] for source in sources for item in source["secret"]["items"]}
        assert files == {
            key_file.name: f"lanes-{identity}-key",
            Path(generated["SSL_CERT_FILE"]).name: "lanes-nats-tls",
            Path(generated["LANES_KEYRING"]).name: "lanes-keyring",
        }, name
        assert (secrets_out / key_file.name).exists()


def test_the_generated_nats_urls_name_the_cluster_nodes(
    by_kind: dict[str, dict[str, dict[str, Any]]], secrets_out: Path
) -> None:
    hosts = _nats_hosts(by_kind)
    for name in _workloads(by_kind):
        identity = "admin" if name == "provision" else name
        urls = _env_file(secrets_out / f"{identity}.env")["NATS_URL"].split(",")
        assert [(urlsplit(u).scheme, urlsplit(u).hostname, urlsplit(u).port) for u in urls] == [
            ("tls", host, 4222) for host in hosts
        ]
        assert {urlsplit(u).username for u in urls} == {identity}


def _secret_names(value: Any) -> Iterator[str]:
    """Every Secret a manifest names (envFrom, secretKeyRef, secret volumes, projected sources)."""
    if isinstance(value, dict):
        if "secretRef" in value:
            yield value["secretRef"]["name"]
        if "secretKeyRef" in value:
            yield value["secretKeyRef"]["name"]
        if "secretName" in value:
            yield value["secretName"]
        if isinstance(value.get("secret"), dict) and "name" in value["secret"]:
            yield value["secret"]["name"]
        for inner in value.values():
            yield from _secret_names(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _secret_names(inner)


def test_every_secret_named_is_made_from_a_file_generate_py_writes(
    rendered: list[dict[str, Any]], secrets_out: Path
) -> None:
    shared = {
        "lanes-nats-tls": ("ca.pem", "nats-cert.pem", "nats-key.pem"),
        "lanes-nats-auth": ("auth.conf",),
        "lanes-keyring": ("keyring.json",),
    }
    named = {name for resource in rendered for name in _secret_names(resource)}
    for name in named - OPERATOR_SECRETS:
        identity = name.removeprefix("lanes-").removesuffix("-key")
        files = shared.get(name) or ((f"{identity}.key",) if name.endswith("-key") else (f"{identity}.env",))
        for file in files:
            assert (secrets_out / file).exists(), f"Secret {name}: generate.py writes no {file}"


# --- The NATS cluster, as the chart lays it out, with the compose cluster's settings -------------------------------


@pytest.fixture(scope="module")
def nats_conf(by_kind: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    return parse_nats_conf(by_kind["ConfigMap"]["nats-config"]["data"]["nats.conf"])


def _mounts(by_kind: dict[str, dict[str, dict[str, Any]]]) -> dict[str, str]:
    """mount path -> what is mounted there (a ConfigMap, a Secret, a claim or an emptyDir)."""
    statefulset = by_kind["StatefulSet"]["nats"]
    volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    claims = {c["metadata"]["name"] for c in statefulset["spec"]["volumeClaimTemplates"]}
    mounts = {}
    for mount in _container(statefulset)["volumeMounts"]:
        volume = volumes.get(mount["name"], {})
        source = (
            f"claim:{mount['name']}"
            if mount["name"] in claims
            else f"configMap:{volume['configMap']['name']}"
            if "configMap" in volume
            else f"secret:{volume['secret']['secretName']}"
            if "secret" in volume
            else "emptyDir"
        )
        mounts[mount["mountPath"]] = source
    return mounts


def test_the_nats_statefulset_is_the_charts_shape(by_kind: dict[str, dict[str, dict[str, Any]]]) -> None:
    statefulset = by_kind["StatefulSet"]["nats"]
    assert statefulset["spec"]["podManagementPolicy"] == "Parallel"
    headless = by_kind["Service"][statefulset["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert {p["port"] for p in headless["spec"]["ports"]} == {4222, 6222, 8222}
    assert [p["port"] for p in by_kind["Service"]["nats"]["spec"]["ports"]] == [4222]  # monitoring stays inside
    container = _container(statefulset)
    assert container["args"] == ["--config", "/etc/nats-config/nats.conf"]
    assert _mounts(by_kind)["/etc/nats-config"] == "configMap:nats-config"
    assert container["env"][0] == {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"].startswith("/healthz")
    assert by_kind["PodDisruptionBudget"]["nats"]["spec"]["maxUnavailable"] == 1


def test_nats_conf_routes_to_every_pod_through_the_headless_service(
    by_kind: dict[str, dict[str, dict[str, Any]]], nats_conf: dict[str, Any]
) -> None:
    routes = [urlsplit(route) for route in nats_conf["cluster"]["routes"]]
    assert [(r.hostname, r.port) for r in routes] == [(host, 6222) for host in _nats_hosts(by_kind)]
    assert nats_conf["server_name"] == "$POD_NAME"
    assert nats_conf["cluster"]["no_advertise"] is True


def test_nats_conf_files_are_where_the_pod_mounts_them(
    by_kind: dict[str, dict[str, dict[str, Any]]], nats_conf: dict[str, Any]
) -> None:
    mounts = _mounts(by_kind)
    assert mounts[nats_conf["jetstream"]["store_dir"]].startswith("claim:")
    for tls in (nats_conf["tls"], nats_conf["cluster"]["tls"]):
        for key in ("cert_file", "key_file", "ca_file"):
            assert mounts[str(Path(tls[key]).parent)] == "secret:lanes-nats-tls", tls[key]
    auth = (Path("/etc/nats-config") / nats_conf["include"]).resolve()
    assert mounts[str(auth.parent)] == "secret:lanes-nats-auth"
    assert auth.name == "auth.conf"
    assert mounts[str(Path(nats_conf["pid_file"]).parent)] == "emptyDir"
    prestop = _container(by_kind["StatefulSet"]["nats"])["lifecycle"]["preStop"]["exec"]["command"]
    assert prestop == ["nats-server", f"-sl=ldm={nats_conf['pid_file']}"]
    ports = {p["name"]: p["containerPort"] for p in _container(by_kind["StatefulSet"]["nats"])["ports"]}
    assert (ports["nats"], ports["cluster"], ports["monitor"]) == (
        nats_conf["port"],
        nats_conf["cluster"]["port"],
        nats_conf["http_port"],
    )


def test_nats_conf_keeps_the_compose_clusters_settings(nats_conf: dict[str, Any]) -> None:
    compose = parse_nats_conf(COMPOSE_NATS_CONF.read_text())
    assert nats_conf["jetstream"]["sync_interval"] == compose["jetstream"]["sync_interval"] == "always"
    assert nats_conf["port"] == compose["port"]
    assert nats_conf["cluster"]["name"] == compose["cluster"]["name"]
    assert nats_conf["cluster"]["tls"]["verify"] is compose["cluster"]["tls"]["verify"] is True
    assert nats_conf["tls"]["timeout"] == compose["tls"]["timeout"]
    assert Path(nats_conf["include"]).name == Path(compose["include"]).name == "auth.conf"
    assert len(nats_conf["cluster"]["routes"]) == len(compose["cluster"]["routes"]) == NATS_REPLICAS


def test_every_manifest_of_the_base_is_in_its_kustomization() -> None:
    base = K8S / "base"
    listed = set(yaml.safe_load((base / "kustomization.yaml").read_text())["resources"])
    assert listed == {path.name for path in base.glob("*.yaml")} - {"kustomization.yaml"}
