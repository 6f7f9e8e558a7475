"""Choosing a replica and taking a slot on it, or the protection mode's answer when none has room."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from lanes_contract.jobs import ProtectionMode
from lanes_router.domain.replicas import Replica, ReplicaRegistry
from lanes_router.domain.requests import (
    InferenceRequest,
    Refusal,
    protection_refusal,
    shared_state_unavailable,
    unknown_model,
    unknown_version,
)
from lanes_router.domain.routing import Lease, RouteTarget, candidates, pick_version
from lanes_router.service_layer.ports import LeaseStore, SharedStateUnavailableError

QUEUE_POLL_S = (0.005, 0.05)
"""How often a queued request looks for a free slot: starts fast, backs off to this ceiling (with jitter)."""


@dataclass(frozen=True, slots=True)
class Granted:
    """A slot on a replica: forward the request there, release the lease when done."""

    replica: Replica
    lease: Lease


class Dispatcher:
    """Routes a request to a replica with room, honouring its pin, the weights and the protection mode."""

    def __init__(self, registry: ReplicaRegistry, leases: LeaseStore, *, rng: random.Random | None = None) -> None:
        self._registry = registry
        self._leases = leases
        self._rng = rng or random.Random()  # noqa: S311 - load balancing, not cryptography

    async def acquire(self, request: InferenceRequest, exclude: frozenset[str] = frozenset()) -> Granted | Refusal:
        """A slot for this request on a replica not in `exclude`, or the answer to give instead."""
        try:
            return await self._acquire(request, exclude)
        except SharedStateUnavailableError as exc:
            return shared_state_unavailable(str(exc))

    async def _acquire(self, request: InferenceRequest, exclude: frozenset[str]) -> Granted | Refusal:
        if request.version is not None:
            versions = tuple(dict.fromkeys(r.version for r in self._registry.of_model(request.model)))
            deployed = self._registry.deployment(request.model, request.version)
            pinned_deployed = deployed is not None and deployed.version == request.version
            if deployed is not None and request.version not in versions and not pinned_deployed:
                # Nothing runs or was submitted under this version: waiting in the queue could not change that.
                return unknown_version(request.model, request.version, versions)
        granted, reason = await self._try_once(request, exclude)
        if granted is not None:
            return granted
        spec = self._registry.deployment(request.model, request.version)
        if spec is None:
            return unknown_model(request.model, self._registry.models())
        if spec.protection is not ProtectionMode.QUEUE:
            return protection_refusal(spec, reason=reason, waited=False)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + spec.queue_timeout_s
        pause = QUEUE_POLL_S[0]
        while (left := deadline - loop.time()) > 0:
            await asyncio.sleep(min(left, pause * (0.5 + self._rng.random())))
            pause = min(QUEUE_POLL_S[1], pause * 2)
            granted, reason = await self._try_once(request, exclude)
            if granted is not None:
                return granted
        return protection_refusal(spec, reason=reason, waited=True)

    async def _try_once(self, request: InferenceRequest, exclude: frozenset[str]) -> tuple[Granted | None, str]:
        replicas = self._registry.of_model(request.model)
        version = request.version or pick_version(replicas, self._rng.random())
        if version is None:
            return None, "no ready replica"
        target = RouteTarget(request.model, version, request.affinity_key)
        offered = candidates(replicas, target, version, exclude, self._rng.randrange)
        if not offered:
            return None, f"no ready replica of version {version}"
        lease = await self._leases.acquire(
            [r.replica_id for r in offered], [r.serving.max_concurrency for r in offered]
        )
        if lease is None:
            return None, f"every ready replica of version {version} is at its concurrency cap"
        chosen = next(r for r in offered if r.replica_id == lease.replica_id)
        return Granted(chosen, lease), ""

    async def shared_state_answers(self) -> bool:
        """Whether the shared lease store answers now (readiness)."""
        return await self._leases.check()

    def release(self, granted: Granted) -> None:
        """Give the slot back."""
        self._leases.release(granted.lease)
