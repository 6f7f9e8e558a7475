"""Static checks of the compose stack: docker-compose.yml, the Dockerfile and the NATS config it mounts.

No Docker engine is needed: the files are parsed and checked against what the code expects (the service
names in `lanes_cli.bootstrap.SERVICES`, the variables in `lanes_runtime.settings.ENV_VARS`).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from lanes_cli.bootstrap import SERVICES
from lanes_runtime.settings import ENV_VARS

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
REQUIRED_ENV = ("NATS_URL", "DATABASE_URL", "REDIS_URL")
NATS_NODE_COUNT = 3
APPS = ("console",)
"""Deployables that are not consumer services (`lanes_cli.bootstrap.SERVICES`): each an image of its own too."""

# --- Loading -------------------------------------------------------------------------------------------------------

_INTERPOLATION = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::?-(?P<default>[^}]*))?\}")


def _interpolate(value: str) -> str:
    """Resolve compose `${VAR}` / `${VAR:-default}` as compose would with VAR unset."""
    return _INTERPOLATION.sub(lambda m: m.group("default") or "", value)


def _environment(service: dict[str, Any]) -> dict[str, str]:
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) if "=" in item else (item, "") for item in raw)
    return {str(key): _interpolate(str(value)) for key, value in raw.items()}


def _command(service: dict[str, Any]) -> list[str]:
    raw = service.get("command")
    if raw is None:
        return []
    return shlex.split(raw) if isinstance(raw, str) else [str(part) for part in raw]


def _depends_on(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    raw = service.get("depends_on") or {}
    if isinstance(raw, list):
        return {name: {"condition": "service_started"} for name in raw}
    return {name: spec or {"condition": "service_started"} for name, spec in raw.items()}


def _volumes(service: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(source, target, read-only) for each volume of a service, short or long syntax."""
    mounts = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, str):
            parts = volume.split(":")
            source, target = parts[0], parts[1]
            read_only = len(parts) > 2 and "ro" in parts[2].split(",")
        else:
            source, target, read_only = volume.get("source", ""), volume["target"], bool(volume.get("read_only"))
        mounts.append((source, target, read_only))
    return mounts


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(loaded, dict)
    assert isinstance(loaded.get("services"), dict)
    return loaded


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose["services"]
    return found


def _image_version(image: str) -> tuple[int, ...]:
    """The version in an image tag: `nats:2.12-alpine` -> (2, 12); fails on an untagged or `latest` image."""
    match = re.fullmatch(r"[^:]+:(\d+(?:\.\d+)*)(?:-[\w.-]+)?", image)
    assert match, f"{image} has no version tag"
    return tuple(int(part) for part in match.group(1).split("."))


def _by_image(services: dict[str, dict[str, Any]], image: str) -> dict[str, dict[str, Any]]:
    """Services whose image is `image` (any tag, any registry prefix)."""
    return {name: spec for name, spec in services.items() if _image_name(spec) == image}


def _image_name(spec: dict[str, Any]) -> str:
    return str(spec.get("image", "")).split(":")[0].rsplit("/", 1)[-1]


@pytest.fixture(scope="module")
def nats_nodes(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return _by_image(services, "nats")


@pytest.fixture(scope="module")
def one_shots(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Tasks that run once before the services (e.g. creating the streams as the admin), then exit."""
    return {name: spec for name, spec in services.items() if "build" in spec and "entrypoint" in spec}


@pytest.fixture(scope="module")
def lanes_containers(
    services: dict[str, dict[str, Any]], one_shots: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The long-running Lanes services, each built from the Dockerfile."""
    return {name: spec for name, spec in services.items() if "build" in spec and name not in one_shots}


# --- A reader for the NATS configuration format (the subset the compose config uses) --------------------------------


class _NatsConfParser:
    """Blocks `{}`, arrays `[]`, `key: value` / `key = value` / `key value`, `#` and `//` comments, quoted
    and bare strings, integers, booleans and `$VAR` references (resolved from the container environment)."""

    def __init__(self, text: str, env: dict[str, str] | None) -> None:
        self.text = text
        self.pos = 0
        self.env = env

    def parse(self) -> dict[str, Any]:
        result = self._entries(closing=None)
        assert self.pos == len(self.text), f"unparsed NATS config from offset {self.pos}"
        return result

    def _skip(self, *, newlines: bool = True) -> None:
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char == "#" or self.text.startswith("//", self.pos):
                end = self.text.find("\n", self.pos)
                self.pos = len(self.text) if end < 0 else end
            elif char in " \t\r;" or (newlines and char in "\n,"):
                self.pos += 1
            else:
                return

    def _entries(self, closing: str | None) -> dict[str, Any]:
        entries: dict[str, Any] = {}
        while True:
            self._skip()
            if self.pos == len(self.text):
                assert closing is None, f"missing {closing!r} in NATS config"
                return entries
            if self.text[self.pos] == closing:
                self.pos += 1
                return entries
            match = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*").match(self.text, self.pos)
            assert match, f"expected a key at offset {self.pos}: {self.text[self.pos : self.pos + 30]!r}"
            key = match.group().lower()
            self.pos = match.end()
            self._skip(newlines=False)
            if self.pos < len(self.text) and self.text[self.pos] in ":=":
                self.pos += 1
                self._skip(newlines=False)
            entries[key] = self._value()

    def _value(self) -> Any:
        char = self.text[self.pos]
        if char == "{":
            self.pos += 1
            return self._entries(closing="}")
        if char == "[":
            self.pos += 1
            items: list[Any] = []
            while True:
                self._skip()
                if self.text[self.pos] == "]":
                    self.pos += 1
                    return items
                items.append(self._value())
        if char in "\"'":
            end = self.text.index(char, self.pos + 1)
            value = self.text[self.pos + 1 : end]
            self.pos = end + 1
            return value
        match = re.compile(r"[^\s,;\]}#]+").match(self.text, self.pos)
        assert match, f"expected a value at offset {self.pos}"
        self.pos = match.end()
        return self._scalar(match.group())

    def _scalar(self, word: str) -> Any:
        if word.startswith("$") and self.env is not None:
            name = word[1:].strip("{}")
            assert name in self.env, f"NATS config refers to ${name}, which the container does not set"
            return self.env[name]
        if word.lower() in {"true", "yes", "on", "enabled"}:
            return True
        if word.lower() in {"false", "no", "off", "disabled"}:
            return False
        return int(word) if word.isdigit() else word


def parse_nats_conf(text: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Parse NATS server configuration text; `$VAR` is looked up in `env`, or left as written without one."""
    return _NatsConfParser(text, env).parse()


def _nats_config(name: str, node: dict[str, Any]) -> dict[str, Any]:
    """The configuration a NATS node runs with: its --config file (from its bind mount) and its flags."""
    command = _command(node)
    flags = command[1:] if command and command[0] == "nats-server" else command
    config_path = None
    for flag, value in zip(flags, [*flags[1:], ""], strict=True):
        if flag in {"-c", "--config", "-config"}:
            config_path = value
    assert config_path, f"{name}: no --config in its command {command}"
    sources = {target: source for source, target, _ in _volumes(node)}
    assert config_path in sources, f"{name}: {config_path} is not mounted into the container"
    host_file = (ROOT / sources[config_path]).resolve()
    assert host_file.is_relative_to(ROOT / "deploy" / "nats"), f"{name}: config must come from deploy/nats/"
    config = parse_nats_conf(host_file.read_text(), _environment(node))
    config["_flags"] = flags
    config["_mounted_read_only"] = {target: ro for _, target, ro in _volumes(node)}[config_path]
    return config


@pytest.fixture(scope="module")
def nats_configs(nats_nodes: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: _nats_config(name, node) for name, node in nats_nodes.items()}


# --- The parser itself --------------------------------------------------------------------------------------------


def test_nats_conf_parser_reads_the_format():
    text = """
    # comment
    server_name: $NAME
    port = 4222
    jetstream {
      store_dir: "/data"   // trailing comment
      sync_interval: always
    }
    cluster { name: c, routes: [ "nats://a:6222", nats://b:6222
      "nats://c:6222" ] }
    debug true
    """
    parsed = parse_nats_conf(text, {"NAME": "n-1"})
    assert parsed == {
        "server_name": "n-1",
        "port": 4222,
        "jetstream": {"store_dir": "/data", "sync_interval": "always"},
        "cluster": {"name": "c", "routes": ["nats://a:6222", "nats://b:6222", "nats://c:6222"]},
        "debug": True,
    }
    with pytest.raises(AssertionError):
        parse_nats_conf("server_name: $UNSET", {})
    with pytest.raises(AssertionError):
        parse_nats_conf("jetstream { store_dir: /data")


# --- NATS ----------------------------------------------------------------------------------------------------------


def test_three_nats_nodes_on_a_version_lanes_supports(nats_nodes, nats_configs):
    assert len(nats_nodes) == NATS_NODE_COUNT, sorted(nats_nodes)
    for name, node in nats_nodes.items():
        assert _image_version(node["image"]) >= (2, 11), f"{name}: {node['image']} is older than NATS 2.11"
        assert nats_configs[name]["_mounted_read_only"], f"{name}: the config should be mounted read-only"
    server_names = {nats_configs[name].get("server_name") for name in nats_nodes}
    assert server_names == {f"nats-{i}" for i in range(1, NATS_NODE_COUNT + 1)}


def test_nats_nodes_run_jetstream_each_on_its_own_volume(compose, nats_nodes, nats_configs):
    stores = {}
    for name, node in nats_nodes.items():
        jetstream = nats_configs[name].get("jetstream")
        assert jetstream, f"{name}: JetStream is not enabled"
        assert isinstance(jetstream, dict), f"{name}: JetStream needs a block with store_dir and sync_interval"
        assert jetstream.get("enabled", True) is not False, f"{name}: JetStream is disabled"
        store_dir = PurePosixPath(jetstream["store_dir"])
        named = {target: source for source, target, _ in _volumes(node) if source in (compose.get("volumes") or {})}
        volume = next((named[t] for t in named if store_dir.is_relative_to(t)), None)
        assert volume, f"{name}: the JetStream store {store_dir} is not on a named volume"
        stores[name] = volume
    assert len(set(stores.values())) == len(stores), f"NATS nodes share a JetStream volume: {stores}"


def test_sync_interval_is_always_wherever_jetstream_is_configured(nats_configs):
    assert nats_configs
    for name, config in nats_configs.items():
        jetstream = config.get("jetstream")
        assert jetstream is not None, f"{name}: no jetstream block"
        sync = jetstream.get("sync_interval", jetstream.get("sync"))
        assert sync == "always", f"{name}: JetStream sync_interval is {sync!r}, not 'always'"
        assert not {"-js", "--js", "--jetstream"} & set(config["_flags"]), f"{name}: JetStream set by flag too"
    for conf in (ROOT / "deploy" / "nats").glob("*.conf"):
        parsed = parse_nats_conf(conf.read_text())
        if "jetstream" in parsed:
            assert isinstance(parsed["jetstream"], dict), f"{conf.name}: jetstream without a settings block"
            assert parsed["jetstream"].get("sync_interval") == "always", f"{conf.name}: sync_interval"


def test_nats_nodes_route_to_each_other(nats_nodes, nats_configs):
    for name, config in nats_configs.items():
        cluster = config.get("cluster")
        assert isinstance(cluster, dict), f"{name}: no cluster block"
        assert cluster.get("name"), f"{name}: the cluster needs a name"
        listen_port = int(str(cluster.get("listen", cluster.get("port", ""))).rsplit(":", 1)[-1])
        routes = [urlsplit(route) for route in cluster.get("routes", [])]
        assert all(route.port == listen_port for route in routes), f"{name}: a route misses port {listen_port}"
        routed = {route.hostname for route in routes}
        others = set(nats_nodes) - {name}
        assert others <= routed, f"{name} has no route to {sorted(others - routed)}"
        assert routed <= set(nats_nodes), f"{name} routes to unknown hosts {sorted(routed - set(nats_nodes))}"
    assert len({config["cluster"]["name"] for config in nats_configs.values()}) == 1


# --- PostgreSQL and Redis ------------------------------------------------------------------------------------------


def test_postgres_and_redis_are_there(services):
    postgres = _by_image(services, "postgres")
    redis = _by_image(services, "redis")
    assert len(postgres) == 1, sorted(postgres)
    assert len(redis) == 1, sorted(redis)
    (pg,) = postgres.values()
    assert _image_version(pg["image"]) >= (15,), pg["image"]
    assert _environment(pg).get("POSTGRES_DB") == "lanes"
    (rd,) = redis.values()
    assert _image_version(rd["image"]) >= (6, 2), rd["image"]


def test_every_server_has_a_healthcheck(services, lanes_containers, one_shots):
    servers = {name: spec for name, spec in services.items() if name not in lanes_containers | one_shots}
    assert len(servers) == NATS_NODE_COUNT + 2
    for name, spec in servers.items():
        test = (spec.get("healthcheck") or {}).get("test")
        assert test, f"{name}: no healthcheck"
        assert test[0] in {"CMD", "CMD-SHELL"}, f"{name}: healthcheck {test}"


# --- The Lanes services --------------------------------------------------------------------------------------------


def test_each_service_has_exactly_one_container_built_for_it(lanes_containers):
    served: dict[str, list[str]] = {}
    for container, spec in lanes_containers.items():
        build = spec["build"]
        assert isinstance(build, dict), f"{container}: build needs args.SERVICE"
        service = build["args"]["SERVICE"]
        assert service in {*SERVICES, *APPS}, f"{container}: builds unknown service {service!r}"
        served.setdefault(service, []).append(container)
    assert set(served) == {*SERVICES, *APPS}, f"not served: {sorted({*SERVICES, *APPS} - set(served))}"
    duplicates = {name: containers for name, containers in served.items() if len(containers) != 1}
    assert not duplicates, duplicates


@pytest.fixture(scope="module")
def secrets_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `deploy/secrets/generate.py` writes (the env files the services read), generated afresh."""
    out = tmp_path_factory.mktemp("secrets") / "out"
    subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "secrets" / "generate.py"), str(out)], check=True, timeout=120
    )
    return out


def _service_environment(spec: dict[str, Any], secrets: Path) -> dict[str, str]:
    """A container's variables: its identity's generated env file, then its own `environment`."""
    env: dict[str, str] = {}
    files = spec.get("env_file") or []
    for name in [files] if isinstance(files, str) else files:
        generated = secrets / Path(name).name
        for line in generated.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                key, _, value = line.partition("=")
                env[key.strip()] = value.strip()
    return env | _environment(spec)


def test_services_set_only_known_variables_and_all_required_ones(lanes_containers, secrets_out):
    assert lanes_containers
    for container, spec in lanes_containers.items():
        env = _service_environment(spec, secrets_out)
        unknown = set(env) - set(ENV_VARS) - {"SSL_CERT_FILE"}  # OpenSSL's own: the CA the NATS client trusts
        assert not unknown, f"{container}: sets {sorted(unknown)}, which Lanes does not read"
        for name in REQUIRED_ENV:
            assert env.get(name), f"{container}: {name} is not set"
        assert env.get("LANES_STREAM_REPLICAS") == str(NATS_NODE_COUNT), container
        assert env.get("LANES_LOG_FORMAT") == "json", container


def test_server_urls_point_at_the_compose_servers(services, lanes_containers, nats_nodes, nats_configs, secrets_out):
    postgres = next(iter(_by_image(services, "postgres")))
    redis = next(iter(_by_image(services, "redis")))
    for container, spec in lanes_containers.items():
        env = _service_environment(spec, secrets_out)
        nats_urls = [urlsplit(url.strip()) for url in env["NATS_URL"].split(",")]
        assert {url.scheme for url in nats_urls} == {"tls"}, container
        assert {url.username for url in nats_urls} == {container}, f"{container} connects as its own identity"
        assert sorted(str(url.hostname) for url in nats_urls) == sorted(nats_nodes), f"{container}: {env['NATS_URL']}"
        for url in nats_urls:
            assert url.port == nats_configs[url.hostname].get("port", 4222), f"{container}: {url.geturl()}"
        database = urlsplit(env["DATABASE_URL"])
        assert database.scheme in {"postgresql", "postgres"}
        assert database.hostname == postgres, container
        assert database.path == "/" + _environment(services[postgres])["POSTGRES_DB"]
        assert database.username == _environment(services[postgres]).get("POSTGRES_USER", "postgres")
        assert database.password == _environment(services[postgres]).get("POSTGRES_PASSWORD")
        cache = urlsplit(env["REDIS_URL"])
        assert cache.scheme == "redis"
        assert cache.hostname == redis, container


def test_depends_on_names_real_containers_and_waits_for_healthy_servers(services, lanes_containers, one_shots):
    for container, spec in services.items():
        for target in _depends_on(spec):
            assert target in services, f"{container} depends on unknown {target!r}"
    servers = set(services) - set(lanes_containers) - set(one_shots)
    for container, spec in lanes_containers.items():
        depends = _depends_on(spec)
        expected = servers | set(one_shots)
        assert set(depends) == expected, f"{container}: depends on {sorted(depends)}, not on {sorted(expected)}"
        for target, condition in depends.items():
            wanted = "service_completed_successfully" if target in one_shots else "service_healthy"
            assert condition.get("condition") == wanted, f"{container} -> {target}: {condition}"


def test_services_restart_and_build_from_the_dockerfile(lanes_containers):
    for container, spec in lanes_containers.items():
        build = spec["build"]
        context = build if isinstance(build, str) else build.get("context", ".")
        assert (ROOT / context).resolve() == ROOT, f"{container}: builds from {context}"
        assert spec.get("restart") in {"always", "unless-stopped", "on-failure"}, container


# --- Dockerfile ----------------------------------------------------------------------------------------------------


def _final_stage() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile's last stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    instructions = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            instruction, _, args = stripped.partition(" ")
            instructions.append((instruction.upper(), args.strip()))
    starts = [i for i, (instruction, _) in enumerate(instructions) if instruction == "FROM"]
    assert starts, "the Dockerfile has no FROM"
    return instructions[starts[-1] :]


def test_dockerfile_runs_one_service_as_a_non_root_user():
    stage = _final_stage()
    base = stage[0][1].split()[0]
    assert base.startswith("python:3.11-slim"), base
    entrypoints = [json.loads(args) for instruction, args in stage if instruction == "ENTRYPOINT"]
    assert entrypoints, "no ENTRYPOINT"
    assert entrypoints[-1] == ["lanes-service"]
    text = DOCKERFILE.read_text()
    assert 'uv sync --no-dev --no-editable --package "lanes-${SERVICE}"' in text
    assert 'ln -s "/opt/lanes/bin/lanes-${SERVICE}" /opt/lanes/bin/lanes-service' in text
    for service in SERVICES:
        scripts = tomllib.loads((ROOT / "services" / service / "pyproject.toml").read_text())["project"]["scripts"]
        assert scripts == {f"lanes-{service}": f"lanes_{service}.__main__:main"}
    for app in APPS:
        scripts = tomllib.loads((ROOT / "apps" / app / "pyproject.toml").read_text())["project"]["scripts"]
        assert scripts == {f"lanes-{app}": f"lanes_{app}.__main__:main"}
    users = [args.split(":")[0] for instruction, args in stage if instruction == "USER"]
    assert users, "the image runs as root"
    assert users[-1] not in {"root", "0"}
    assert "COPY uv.lock" not in text, "the image must not use a committed lock file"
