"""Who is looking (pure): the viewer token sees every job; a tenant's API key sees only that tenant's jobs.

The tenants are the router's: the same tenants file (`LANES_ROUTER_TENANTS_FILE`, given to the console as
LANES_CONSOLE_TENANTS_FILE) names each tenant with the SHA-256 of its key, never the key. A presented
credential is compared in constant time, with the viewer token and with every tenant key's hash.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lanes_contract.ids import is_valid_token

_SHA256_HEX = 64


@dataclass(frozen=True)
class Viewer:
    """A person or client let in, and the one tenant whose jobs it may see (None: every tenant)."""

    tenant: str | None = None

    def sees(self, tenant: str) -> bool:
        """Whether this viewer may see a job of `tenant`."""
        return self.tenant is None or self.tenant == tenant


EVERYONE = Viewer()


def tenant_keys(raw: Mapping[str, Any]) -> dict[str, str]:
    """The key hash -> tenant name of a router tenants file (`{"tenants": {name: {"key_sha256": hex}}}`)."""
    keys: dict[str, str] = {}
    for name, spec in dict(raw.get("tenants") or {}).items():
        if not is_valid_token(str(name)):
            msg = f"tenant name {str(name)[:40]!r} must be 1-128 characters from A-Z a-z 0-9 _ -"
            raise ValueError(msg)
        digest = str((spec or {}).get("key_sha256", "")).lower()
        if len(digest) != _SHA256_HEX or any(c not in "0123456789abcdef" for c in digest):
            msg = f"tenant {name}: key_sha256 must be the 64 hex digits of the key's SHA-256"
            raise ValueError(msg)
        keys[digest] = str(name)
    return keys


def load_tenant_keys(path: str) -> dict[str, str]:
    """The tenant keys of a tenants file; ValueError naming the file when it cannot be read."""
    try:
        return tenant_keys(json.loads(Path(path).read_text()))
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        msg = f"LANES_CONSOLE_TENANTS_FILE {path}: {exc}"
        raise ValueError(msg) from exc


def viewer_of(credential: str, token: str | None, keys: Mapping[str, str]) -> Viewer | None:
    """The viewer a presented credential makes: the token's (every tenant), a tenant key's, or None."""
    if not credential:
        return None
    if token is not None and hmac.compare_digest(credential.encode(), token.encode()):
        return EVERYONE
    digest = hashlib.sha256(credential.encode()).hexdigest()
    for known, tenant in keys.items():
        if hmac.compare_digest(digest, known):
            return Viewer(tenant)
    return None
