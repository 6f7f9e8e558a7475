"""Real servers for the tests, chosen per server in the order of docs/architecture.md, "Runtime modes".

1. The URL in the environment (NATS_URL, DATABASE_URL, REDIS_URL), if it answers. A NATS that is too old
   stops the whole run with Lanes' refusal message: the tests never quietly fall back.
2. A container, when a Docker engine answers a ping (testcontainers).
3. The embedded server from the project's wheels.

Nothing is ever skipped for want of a server: if none of the three works, the run fails and says why.
Each test gets its own PostgreSQL database; NATS isolation comes from unique job ids and consumer names.
The embedded NATS runs with auth on (docs/architecture.md, "Trust"): `servers.nats_url` carries the admin's credentials,
so every test connects authenticated and may write any subject; tests of least privilege take
`secured_nats` and connect as the identity they exercise.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import asyncpg
import pytest
from hypothesis import settings

from lanes_contract.client import LanesClient, connect_nats
from lanes_contract.errors import LanesError, UnsupportedServerError
from lanes_contract.streams import provision_streams
from lanes_runtime.cache import connect_redis
from lanes_runtime.settings import ServerUrls
from lanes_sandbox.embedded import EmbeddedNats, EmbeddedPostgres, EmbeddedRedis

# Property tests are derandomized by default, so every run (a developer's, CI's) tries the same examples
# and a failure reproduces. `.ci/run` also runs them once under "random" with a seed it prints.
settings.register_profile("fixed", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("random", derandomize=False, deadline=None, print_blob=True, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))


def _docker_answers() -> bool:
    try:
        import docker  # noqa: PLC0415 - only needed when looking for an engine

        docker.from_env(timeout=3).ping()
    except Exception:  # noqa: BLE001 - any failure means "no engine"
        return False
    return True


def _container(image: str, port: int, **env: str) -> Iterator[tuple[str, int]]:
    from testcontainers.core.container import DockerContainer  # noqa: PLC0415

    container = DockerContainer(image).with_exposed_ports(port).with_envs(**env)
    if image.startswith("nats"):
        container = container.with_command("-js")
    with container:
        yield container.get_container_host_ip(), int(container.get_exposed_port(port))


async def _answers(kind: str, url: str) -> None:
    if kind == "nats":
        nc = await connect_nats(url, name="lanes-tests")
        await nc.close()
    elif kind == "postgres":
        conn = await asyncpg.connect(url, timeout=5)
        await conn.close()
    else:
        client = await connect_redis(url)
        await client.aclose()


def _provided(kind: str, env: str) -> str | None:
    url = os.environ.get(env)
    if not url:
        return None
    try:
        asyncio.run(_answers(kind, url))
    except UnsupportedServerError as exc:
        pytest.exit(f"{env}: {exc}", returncode=4)
    except (LanesError, OSError, asyncpg.PostgresError) as exc:
        pytest.exit(f"{env}={url} does not answer ({exc}); unset it to use an embedded server", returncode=4)
    return url


_IMAGES = {
    "nats": ("nats:2.12-alpine", 4222, {}, "nats://{host}:{port}"),
    "postgres": (
        "postgres:16",
        5432,
        {"POSTGRES_HOST_AUTH_METHOD": "trust"},
        "postgresql://postgres@{host}:{port}/postgres",
    ),
    "redis": ("redis:7", 6379, {}, "redis://{host}:{port}/0"),
}
_EMBEDDED: dict[str, Callable[[], Any]] = {"nats": EmbeddedNats, "postgres": EmbeddedPostgres, "redis": EmbeddedRedis}


@pytest.fixture(scope="session")
def servers() -> Iterator[ServerUrls]:
    """The three servers, resolved once per test session."""
    urls: dict[str, str] = {}
    use_docker: bool | None = None
    with contextlib.ExitStack() as stack:
        for kind, env in (("nats", "NATS_URL"), ("postgres", "DATABASE_URL"), ("redis", "REDIS_URL")):
            provided = _provided(kind, env)
            if provided:
                urls[kind] = provided
                continue
            if use_docker is None:
                use_docker = _docker_answers()
            if use_docker:
                image, port, env_vars, template = _IMAGES[kind]
                host, mapped = stack.enter_context(contextlib.contextmanager(_container)(image, port, **env_vars))
                urls[kind] = template.format(host=host, port=mapped)
            else:
                urls[kind] = stack.enter_context(_EMBEDDED[kind]()).url
        yield ServerUrls(nats_url=urls["nats"], database_url=urls["postgres"], redis_url=urls["redis"])


def _with_database(url: str, database: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{database}"


@pytest.fixture
async def database_url(servers: ServerUrls) -> AsyncIterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards."""
    name = f"lanes_test_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(servers.database_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield _with_database(servers.database_url, name)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture
def urls(servers: ServerUrls, database_url: str) -> ServerUrls:
    """The servers with this test's own database."""
    return ServerUrls(nats_url=servers.nats_url, database_url=database_url, redis_url=servers.redis_url)


@pytest.fixture
def own_urls(urls: ServerUrls) -> Iterator[ServerUrls]:
    """This test's database and Redis, with a NATS server of its own (fresh streams, no other consumers)."""
    with EmbeddedNats() as nats:
        yield ServerUrls(nats_url=nats.url, database_url=urls.database_url, redis_url=urls.redis_url)


@pytest.fixture
def secured_nats() -> Iterator[EmbeddedNats]:
    """A NATS server of this test's own, always embedded, with every Lanes identity (auth is always on).

    `.url` is the admin's URL; `.url_for("scheduler")`, `.url_for("agent-node-1")`, ... connect as the
    other identities, for tests of who may write what.
    """
    with EmbeddedNats() as nats:
        yield nats


@pytest.fixture
async def lanes(urls: ServerUrls) -> AsyncIterator[LanesClient]:
    """A producer client on the test's NATS (source "tests"), with the streams provisioned."""
    client = await LanesClient.connect(urls.nats_url, source="tests")
    await provision_streams(client.js)
    yield client
    await client.close()


@pytest.fixture
def unique() -> str:
    """A short unique token for job ids, consumer names and subjects of one test."""
    return uuid.uuid4().hex[:10]
