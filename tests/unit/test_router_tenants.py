"""Tenants of the router, as pure rules: keys by hash, a token bucket per tenant, a cap on requests in flight."""

from __future__ import annotations

import pytest

from lanes_router.domain.tenants import TenantLimits, TenantTable, bearer_key, key_hash

TABLE = TenantTable.from_mapping(
    {
        "admin_key_sha256": key_hash("admin-secret"),
        "tenants": {
            "team-a": {"key_sha256": key_hash("a-secret"), "rate_per_s": 2, "burst": 2, "max_concurrency": 1},
            "team-b": {"key_sha256": key_hash("b-secret"), "rate_per_s": 100, "burst": 100, "max_concurrency": 50},
        },
    }
)


def test_a_key_names_its_tenant_and_nothing_else() -> None:
    tenant = TABLE.tenant_of(bearer_key("Bearer a-secret"))
    assert tenant is not None
    assert tenant.name == "team-a"
    assert TABLE.tenant_of(bearer_key("Bearer nope")) is None
    assert TABLE.tenant_of(bearer_key("Basic a-secret")) is None
    assert TABLE.tenant_of(None) is None
    assert TABLE.is_admin("admin-secret")
    assert not TABLE.is_admin("a-secret")


def test_a_tenant_is_held_to_its_concurrency_and_its_rate() -> None:
    limits = TenantLimits()
    a = TABLE.tenant_of("a-secret")
    assert a is not None
    assert limits.admit(a, now=0.0) is None
    busy = limits.admit(a, now=0.0)
    assert busy is not None
    assert (busy.http_status, busy.error_type) == (429, "tenant_concurrency_limit")
    limits.release(a)
    assert limits.admit(a, now=0.0) is None  # the second token of the burst
    limits.release(a)
    over = limits.admit(a, now=0.0)
    assert over is not None
    assert (over.http_status, over.error_type, over.retry_after_s) == (429, "tenant_rate_limit", 1)
    assert limits.admit(a, now=0.5) is None  # half a second at 2/s refills one token


def test_one_tenant_over_its_limits_does_not_limit_another() -> None:
    limits = TenantLimits()
    a, b = TABLE.tenant_of("a-secret"), TABLE.tenant_of("b-secret")
    assert a is not None
    assert b is not None
    assert limits.admit(a, now=0.0) is None
    assert limits.admit(a, now=0.0) is not None
    assert all(limits.admit(b, now=0.0) is None for _ in range(50))


def test_a_tenants_file_without_an_admin_key_is_refused() -> None:
    with pytest.raises(ValueError, match="admin_key_sha256"):
        TenantTable.from_mapping({"tenants": {}})
