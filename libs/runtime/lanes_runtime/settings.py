"""Settings from the environment. Unset server URLs mean "start embedded servers" where that applies."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lanes_contract.signing import Keyring

ENV_VARS = {
    "NATS_URL": "NATS with JetStream (>= 2.11), e.g. nats://127.0.0.1:4222; comma-separated for a cluster",
    "DATABASE_URL": "PostgreSQL (>= 15), e.g. postgresql://postgres@127.0.0.1:5432/lanes",
    "REDIS_URL": "Redis (>= 6.2), e.g. redis://127.0.0.1:6379/0",
    "LANES_STREAM_REPLICAS": "JetStream replicas for the timeline streams (1 embedded, 3 on a cluster)",
    "LANES_AUDIT_KEY": "audit service: Ed25519 seed (64 hex digits) that signs chain checkpoints",
    "LANES_AUDIT_KEY_FILE": "audit service: a file holding that seed, instead of LANES_AUDIT_KEY",
    "LANES_ROUTER_HOST": "router: the address its HTTP front binds (default 127.0.0.1; 0.0.0.0 in a container)",
    "LANES_ROUTER_PORT": "router: the port of its HTTP front (default 8080; 0 picks a free port and logs the URL)",
    "LANES_ROUTER_MAX_ATTEMPTS": "router: tries of one request on different replicas before any byte is sent (3)",
    "LANES_ROUTER_FIRST_TOKEN_TIMEOUT_S": "router: a stream's first byte later than this is tried elsewhere (30)",
    "LANES_ROUTER_REQUEST_TIMEOUT_S": "router: a non-streaming answer later than this is tried elsewhere (600)",
    "LANES_ROUTER_LEASE_TTL_S": "router: concurrency lease TTL; a crashed router's slots free after it (10)",
    "LANES_ROUTER_PREFIX_AFFINITY": "router: 1 to prefer the same replica for the same prompt prefix (KV cache)",
    "LANES_RECOVERY_POLICY": "recovery: a policy YAML file to run instead of the shipped one (docs/recovery.md)",
    "LANES_SIGNING_KEY_FILE": "a producer: its identity's Ed25519 signing key; every event it publishes is signed",
    "LANES_KEYRING": "the public keys of the identities allowed to sign (keyring.json): every service verifies each"
    " event against it before acting (a forged one is dead-lettered), and audit verify checks the chain with it",
    "LANES_SETTLE_WINDOW_S": "telemetry: seconds after an attempt fails before its finding settles anyway (5)",
    "LANES_CAUSE_WINDOW_S": "telemetry: seconds before an attempt's first exit that evidence may explain it (300)",
    "LANES_ROUTER_TENANTS_FILE": "router: tenants with their API key hashes and rate / concurrency limits",
    "LANES_METRICS_PORT": "a service process: serve Prometheus /metrics on this port (unset: no endpoint)",
    "LANES_METRICS_HOST": "the address /metrics binds (default 127.0.0.1; 0.0.0.0 in a container, to be scraped)",
    "LANES_AUDIT_GAP_BOUND_S": "audit service: seconds a gap in the copy may wait to fill before it is not ready (60)",
    "LANES_CONSOLE_HOST": "console: the address its HTTP server binds (default 127.0.0.1; 0.0.0.0 in a container)",
    "LANES_CONSOLE_TOKEN": "console: the viewer token every page and feed asks for (unset: a random one, logged once)",
    "LANES_CONSOLE_PORT": "console: the port of its HTTP server (default 8090; 0 picks a free port and logs the URL)",
    "LANES_LOG_LEVEL": "debug | info | warning | error (default info)",
    "LANES_LOG_FORMAT": "json | console (default: console on a terminal, json otherwise)",
}
"""Every environment variable Lanes reads, with what it means (the README and compose file use these)."""


@dataclass(frozen=True)
class ServerUrls:
    """Where the three servers are."""

    nats_url: str
    database_url: str
    redis_url: str


@dataclass(frozen=True)
class Settings:
    """Process-wide configuration, read once at start-up."""

    nats_url: str | None
    database_url: str | None
    redis_url: str | None
    stream_replicas: int = 1
    log_level: str = "info"
    log_format: str | None = None
    keyring_file: str | None = None
    """LANES_KEYRING: unset, consumers act on events without checking who signed them."""

    @classmethod
    def from_env(cls) -> Settings:
        """Read the settings from the environment variables listed in `ENV_VARS`."""
        replicas = os.environ.get("LANES_STREAM_REPLICAS", "1")
        if not replicas.isdigit() or int(replicas) not in {1, 3, 5}:
            msg = f"LANES_STREAM_REPLICAS must be 1, 3 or 5, not {replicas!r}"
            raise ValueError(msg)
        return cls(
            nats_url=os.environ.get("NATS_URL") or None,
            database_url=os.environ.get("DATABASE_URL") or None,
            redis_url=os.environ.get("REDIS_URL") or None,
            stream_replicas=int(replicas),
            log_level=os.environ.get("LANES_LOG_LEVEL", "info"),
            log_format=os.environ.get("LANES_LOG_FORMAT") or None,
            keyring_file=os.environ.get("LANES_KEYRING") or None,
        )


def configured_keyring(settings: Settings | None = None) -> Keyring | None:
    """The keyring LANES_KEYRING names, read at a process's start (a file that is not one fails it), or None.

    `lanes up` and `lanes demo` set it to their embedded server's keyring; compose sets it for each service.
    """
    path = (settings or Settings.from_env()).keyring_file
    return Keyring.load(Path(path)) if path else None
