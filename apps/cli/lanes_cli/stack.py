"""The servers a command runs against: those named by the environment, embedded ones for the rest."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path

import structlog

from lanes_contract.client import SIGNING_KEY_ENV
from lanes_contract.identities import PLATFORM
from lanes_contract.signing import KEYRING_ENV
from lanes_runtime.settings import ServerUrls, Settings
from lanes_sandbox.embedded import KEYRING_FILE, EmbeddedNats, EmbeddedNatsCluster, EmbeddedPostgres, EmbeddedRedis

log = structlog.get_logger(__name__)
_embedded_credentials: ContextVar[Path | None] = ContextVar("lanes_embedded_credentials", default=None)
"""The credentials directory of the NATS server `servers()` embedded, while it runs."""
_embedded_url_for: ContextVar[Callable[[str], str] | None] = ContextVar("lanes_embedded_url_for", default=None)
"""Each identity's URL on the NATS server (or cluster) `servers()` embedded, while it runs."""
_embedded_cluster: ContextVar[EmbeddedNatsCluster | None] = ContextVar("lanes_embedded_cluster", default=None)
OPERATOR = "cli"
"""The identity of a person at the `lanes` command line (lanes_contract.identities)."""


@contextlib.contextmanager
def servers(settings: Settings, *, cluster: int = 0) -> Iterator[ServerUrls]:
    """Yield the three server URLs; servers not given by NATS_URL / DATABASE_URL / REDIS_URL are embedded.

    With `cluster` (3 or more), the embedded NATS is that many servers routed into one JetStream cluster, the
    timeline's streams at R3 and every write fsynced before it is acknowledged (`sync_interval: always`).
    Embedded servers are stopped and their data removed on exit, Ctrl-C included.
    """
    with contextlib.ExitStack() as stack:
        nats_url = settings.nats_url
        if nats_url is None:
            # Auth is on: the embedded server provisions the streams as its admin, and this process (all
            # services in one) connects as `platform`; every other identity's URL is in credentials_dir.
            nats: EmbeddedNats
            if cluster:
                routed = stack.enter_context(EmbeddedNatsCluster(cluster))
                stack.callback(_embedded_cluster.reset, _embedded_cluster.set(routed))
                # Every server holds the same users; the first one's keys are the ones this stack signs with.
                nats, url_for = routed.servers[0], routed.url_for
            else:
                nats = stack.enter_context(EmbeddedNats())
                url_for = nats.url_for
            stack.callback(_embedded_url_for.reset, _embedded_url_for.set(url_for))
            nats_url = url_for(PLATFORM.name)
            # This process signs its events as `platform`; `lanes audit verify` checks them against the keyring.
            # Both live in this server's temp directory, so they are unset again when it stops (a second
            # embedded server in the same process, as a bench's next run, has keys of its own).
            stack.enter_context(_env_default(SIGNING_KEY_ENV, str(nats.credentials_dir / f"{PLATFORM.name}.key")))
            stack.enter_context(_env_default(KEYRING_ENV, str(nats.credentials_dir / KEYRING_FILE)))
            stack.callback(_embedded_credentials.reset, _embedded_credentials.set(nats.credentials_dir))
            log.info("embedded nats credentials", directory=str(nats.credentials_dir))
        database_url = settings.database_url or stack.enter_context(EmbeddedPostgres()).url
        redis_url = settings.redis_url or stack.enter_context(EmbeddedRedis()).url
        embedded = [
            name
            for name, given in (
                ("nats", settings.nats_url),
                ("postgres", settings.database_url),
                ("redis", settings.redis_url),
            )
            if not given
        ]
        if embedded:
            log.info("embedded servers started", servers=embedded)
        yield ServerUrls(nats_url=nats_url, database_url=database_url, redis_url=redis_url)


def signing_exports(identity: str = OPERATOR) -> list[tuple[str, str]]:
    """The key `identity` signs with and the keyring that verifies it, from the embedded NATS's credentials.

    For the `export` lines of `lanes up`: a command run after them signs its events, so `lanes audit verify
    --keyring` finds them signed. None when NATS_URL names a server of yours (its keys are yours to hand out).
    """
    credentials = _embedded_credentials.get()
    if credentials is None:
        return []
    return [(SIGNING_KEY_ENV, str(credentials / f"{identity}.key")), (KEYRING_ENV, str(credentials / KEYRING_FILE))]


def identity_url(identity: str, given: str) -> str:
    """The URL that connects to the embedded NATS as `identity` (every server of a cluster), else `given`.

    `lanes up` runs the console as its own read-only identity, not as the platform it runs the services as.
    """
    url_for = _embedded_url_for.get()
    return given if url_for is None else url_for(identity)


def embedded_credentials() -> Path | None:
    """The embedded NATS's credentials directory (each identity's signing key, the keyring), while it runs."""
    return _embedded_credentials.get()


def embedded_cluster() -> EmbeddedNatsCluster | None:
    """The embedded NATS cluster `servers(cluster=...)` runs, while it runs (for the fault checker)."""
    return _embedded_cluster.get()


@contextlib.contextmanager
def _env_default(name: str, value: str) -> Iterator[None]:
    """Set an environment variable the user did not set, for the duration of the block."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
