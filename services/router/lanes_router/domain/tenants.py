"""Tenants of the router: who is asking (an API key), how fast and how much at once they may ask.

Pure rules with the clock passed in. Keys are known only by their SHA-256 (the tenants file never holds a
key itself); a presented key is hashed and compared in constant time. Each tenant has a token bucket
(`rate_per_s`, `burst`) and a cap on its requests in flight in this router process.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lanes_contract.ids import is_valid_token
from lanes_router.domain.requests import Refusal


@dataclass(frozen=True)
class Tenant:
    """One tenant: its name (it appears in provenance), its key's hash and its limits."""

    name: str
    key_sha256: str
    rate_per_s: float
    burst: int
    max_concurrency: int


def key_hash(key: str) -> str:
    """The hex SHA-256 a tenants file holds for a key (`printf %s KEY | sha256sum`)."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class TenantTable:
    """The tenants and the admin's key hash, as a tenants file gives them."""

    tenants: tuple[Tenant, ...]
    admin_key_sha256: str

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> TenantTable:
        """`{"admin_key_sha256": hex, "tenants": {name: {key_sha256, rate_per_s, burst, max_concurrency}}}`."""
        tenants = []
        for name, spec in dict(raw.get("tenants") or {}).items():
            if not is_valid_token(str(name)):
                msg = f"tenant name {name!r} must be 1-128 characters from A-Z a-z 0-9 _ -"
                raise ValueError(msg)
            rate = float(spec.get("rate_per_s", 10.0))
            tenants.append(
                Tenant(
                    name=str(name),
                    key_sha256=str(spec["key_sha256"]).lower(),
                    rate_per_s=rate,
                    burst=int(spec.get("burst", max(1, math.ceil(rate)))),
                    max_concurrency=int(spec.get("max_concurrency", 8)),
                )
            )
        admin = str(raw.get("admin_key_sha256") or "").lower()
        if not admin:
            msg = "a tenants file needs admin_key_sha256: the admin routes must not be open"
            raise ValueError(msg)
        return cls(tuple(tenants), admin)

    def tenant_of(self, key: str | None) -> Tenant | None:
        """The tenant whose key this is, or None."""
        if not key:
            return None
        presented = key_hash(key)
        return next((t for t in self.tenants if hmac.compare_digest(t.key_sha256, presented)), None)

    def is_admin(self, key: str | None) -> bool:
        """Whether this is the admin's key."""
        return bool(key) and hmac.compare_digest(self.admin_key_sha256, key_hash(key or ""))


def bearer_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header."""
    if not authorization:
        return None
    scheme, _, key = authorization.partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


UNAUTHENTICATED = Refusal(401, "invalid_api_key", "an API key is required: Authorization: Bearer <key>")


@dataclass
class _Usage:
    tokens: float
    updated: float
    in_flight: int = 0


@dataclass
class TenantLimits:
    """The token buckets and in-flight counts of every tenant in this router process."""

    _usage: dict[str, _Usage] = field(default_factory=dict)

    def admit(self, tenant: Tenant, now: float) -> Refusal | None:
        """Take one request for `tenant` at `now` (monotonic seconds), or the 429 to answer instead."""
        usage = self._usage.setdefault(tenant.name, _Usage(tokens=float(tenant.burst), updated=now))
        usage.tokens = min(float(tenant.burst), usage.tokens + (now - usage.updated) * tenant.rate_per_s)
        usage.updated = now
        if usage.in_flight >= tenant.max_concurrency:
            message = f"tenant {tenant.name} has {usage.in_flight} requests in flight, its limit"
            return Refusal(429, "tenant_concurrency_limit", message, 1)
        if usage.tokens < 1:
            wait_s = (1 - usage.tokens) / tenant.rate_per_s if tenant.rate_per_s > 0 else 60.0
            message = f"tenant {tenant.name} is over its rate of {tenant.rate_per_s:g} requests/s"
            return Refusal(429, "tenant_rate_limit", message, max(1, math.ceil(wait_s)))
        usage.tokens -= 1
        usage.in_flight += 1
        return None

    def release(self, tenant: Tenant) -> None:
        """A request of `tenant` has finished."""
        usage = self._usage.get(tenant.name)
        if usage is not None and usage.in_flight > 0:
            usage.in_flight -= 1
