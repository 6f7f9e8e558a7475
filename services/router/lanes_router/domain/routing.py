"""The routing choice: which version a request goes to, and which replicas to offer the lease script, in order.

Versions never mix silently: a pinned request only ever sees replicas of its version; an unpinned one goes
to a version drawn by the deployment's explicit weights (weight 0 = only reachable when pinned). Among the
ready replicas of that version the choice is power-of-two-choices on outstanding requests: two replicas are
drawn (the first by prefix affinity when the request has a prefix), and the lease script in Redis takes the
less loaded one that is under its cap, so the choice and the slot are one round trip. The remaining ready
replicas follow as fallbacks, used only when both drawn ones are full.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lanes_router.domain.replicas import Replica

MAX_FALLBACKS = 6
"""Extra replicas offered after the two drawn ones: enough to find room, few enough to keep the script cheap."""


@dataclass(frozen=True, slots=True)
class Lease:
    """A held concurrency slot on one replica (its id in the replica's lease set)."""

    replica_id: str
    lease_id: str


@dataclass(frozen=True, slots=True)
class RouteTarget:
    """What a request asks for: a model, maybe a pinned version, and maybe a prefix for cache affinity."""

    model: str
    version: str | None = None
    affinity_key: str | None = None


def routable_versions(replicas: Sequence[Replica]) -> dict[str, int]:
    """The traffic weight of each version that has a ready replica (the newest replica's spec speaks for it)."""
    weights: dict[str, int] = {}
    for replica in replicas:
        if replica.routable:
            weights[replica.version] = replica.serving.weight
    return weights


def pick_version(replicas: Sequence[Replica], roll: float) -> str | None:
    """The version for an unpinned request: drawn by weight among versions with a ready replica.

    `roll` is uniform in [0, 1). Versions with weight 0 are never drawn; None when no version can take it.
    """
    weights = {version: weight for version, weight in routable_versions(replicas).items() if weight > 0}
    total = sum(weights.values())
    if total == 0:
        return None
    point = roll * total
    for version, weight in sorted(weights.items()):
        if point < weight:
            return version
        point -= weight
    return max(weights)  # only reached by rounding at roll ~ 1


def affinity_rank(replica_id: str, key: str) -> bytes:
    """Rendezvous-hash rank of a replica for an affinity key: the same prefix prefers the same replica."""
    return hashlib.blake2b(f"{key}\x1f{replica_id}".encode(), digest_size=8).digest()


def candidates(
    replicas: Sequence[Replica],
    target: RouteTarget,
    version: str,
    exclude: frozenset[str],
    draw: Callable[[int], int],
) -> list[Replica]:
    """Ready replicas of `version` not in `exclude`: the two drawn first, then up to MAX_FALLBACKS others.

    `draw(n)` returns a uniform integer in [0, n) (the caller's random source, so tests can fix it).
    """
    pool = [r for r in replicas if r.routable and r.version == version and r.replica_id not in exclude]
    if len(pool) <= 1:
        return pool
    ordered: list[Replica] = []
    if target.affinity_key:
        key = target.affinity_key
        preferred = max(pool, key=lambda r: affinity_rank(r.replica_id, key))
        ordered.append(preferred)
        pool.remove(preferred)
    while pool and len(ordered) < 2 + MAX_FALLBACKS:
        ordered.append(pool.pop(draw(len(pool))))
    return ordered
