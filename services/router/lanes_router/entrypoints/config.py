"""The router's settings, from `LANES_ROUTER_*` environment variables (listed in lanes_runtime.settings.ENV_VARS)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from lanes_router.domain.tenants import TenantTable


@dataclass(frozen=True)
class RouterConfig:
    """How one router process listens, retries, times out, leases and probes."""

    host: str = "127.0.0.1"
    port: int = 8080
    """0 picks a free port (the runner logs the URL and exposes it)."""
    strict_port: bool = False
    """Fail when `port` is taken. Set when LANES_ROUTER_PORT is given; otherwise (`lanes up`, the demo, several
    stacks on one machine) a taken default port falls back to a free one, with a warning naming it."""
    max_attempts: int = 3
    """Tries of one request on different replicas, while nothing has reached the client."""
    connect_timeout_s: float = 2.0
    first_token_timeout_s: float = 30.0
    """A stream whose first byte takes longer is a slow first token: tried elsewhere."""
    request_timeout_s: float = 600.0
    """A non-streaming answer that takes longer is a timeout: tried elsewhere."""
    stream_idle_timeout_s: float = 60.0
    """A stream silent this long mid-way is a failed replica: continued on another when its spec allows it."""
    lease_ttl_s: float = 10.0
    probe_interval_s: float = 1.0
    ready_probe_interval_s: float = 5.0
    probe_timeout_s: float = 2.0
    failures_to_eject: int = 2
    penalty_base_s: float = 1.0
    penalty_max_s: float = 30.0
    prefix_affinity: bool = False
    shutdown_timeout_s: float = 30.0
    """How long a stopping router lets in-flight requests finish."""
    header_timeout_s: float = 10.0
    """A new connection that has not sent a whole request head by then is closed (slow-header flood)."""
    idle_timeout_s: float = 30.0
    """A kept-alive connection idle this long between requests is closed."""
    max_connections: int = 4096
    """Open client connections; past it a new one gets 503 with Retry-After and is closed."""
    tenants_file: str = ""
    """A JSON file of tenants (API key hashes, rate and concurrency limits) and the admin key's hash; when
    set, every request needs a tenant's key and /readyz and /metrics the admin's (README, Security model)."""
    shared_state_timeout_s: float = 1.0
    """How long a request waits for Redis (leases) before it gets 503 with Retry-After, and /readyz says no."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RouterConfig:
        """Read `LANES_ROUTER_<FIELD>` for each field (e.g. LANES_ROUTER_PORT); a bad value is a clear error."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for field in fields(cls):
            name = f"LANES_ROUTER_{field.name.upper()}"
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            kind: type[Any] = type(field.default)
            try:
                if kind is bool:
                    values[field.name] = raw.lower() in {"1", "true", "yes", "on"}
                elif kind is int:
                    values[field.name] = int(raw)
                elif kind is float:
                    values[field.name] = float(raw)
                else:
                    values[field.name] = raw
            except ValueError:
                msg = f"{name} must be of type {kind.__name__}, not {raw!r}"
                raise ValueError(msg) from None
        values.setdefault("strict_port", "port" in values)
        return cls(**values)  # type: ignore[arg-type]


def load_tenants(path: str) -> TenantTable | None:
    """The tenants of a tenants file, or None when no file is configured (an open router)."""
    if not path:
        return None
    try:
        return TenantTable.from_mapping(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        msg = f"LANES_ROUTER_TENANTS_FILE {path}: {exc}"
        raise ValueError(msg) from exc
