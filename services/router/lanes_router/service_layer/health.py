"""Health: active probes, passive signals from requests, the penalty box, and publishing what changed.

A transition this router observes (a probe passed: ready; failures piled up: unhealthy with a penalty) is
applied to the local registry at once and published as `ReplicaStateChanged` on the job's timeline, so
every router folds it and it shows on the job's swimlanes. Two routers observing the same transition
publish it once: the first to claim (replica, attempt, generation) in Redis publishes, with an id derived
from that triple, so even a double publish is dropped by JetStream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Literal

import structlog

from lanes_contract.events import ReplicaState, ReplicaStateChanged, ReplicaStateChangedData
from lanes_contract.ids import derived_event_id
from lanes_router.domain.health import Outcome, PenaltyPolicy
from lanes_router.domain.replicas import Replica, ReplicaRegistry, Transition
from lanes_router.service_layer.ports import EventPublisher, FailureCounter

log = structlog.get_logger(__name__)
ProbeResult = Literal["ok", "refused", "error", "timeout"]
Probe = Callable[[str], Awaitable[ProbeResult]]
"""GET `<endpoint>/health`; how it went."""
Signal = Literal["placement", "probe", "passive", "recovery", "operator", "lifecycle"]
SOURCE = "lanes/router"
_STATE_TYPE = ReplicaStateChanged.model_fields["type"].default


def transition_event(
    replica: Replica,
    state: ReplicaState,
    *,
    signal: Signal,
    reason: str,
    penalty_s: float | None = None,
    source: str = SOURCE,
) -> ReplicaStateChanged:
    """The event of a replica leaving its current state; its id is the same in every router that builds it."""
    key = f"{replica.replica_id}:{replica.attempt}:{replica.generation}"
    return ReplicaStateChanged(
        id=derived_event_id(key, _STATE_TYPE, state.value),
        source=source,
        jobid=replica.replica_id,
        attempt=replica.attempt,
        node=replica.node,
        data=ReplicaStateChangedData(
            replica=replica.replica_id,
            model=replica.model,
            version=replica.version,
            state=state,
            previous=replica.state,
            reason=reason,
            signal=signal,
            endpoint=replica.endpoint,
            gpus=replica.gpus,
            penalty_s=penalty_s,
        ),
    )


class HealthMonitor:
    """Probes replicas, takes passive signals, and publishes the transitions it observes (once per cluster)."""

    def __init__(
        self,
        registry: ReplicaRegistry,
        failures: FailureCounter,
        publisher: EventPublisher,
        probe: Probe,
        *,
        policy: PenaltyPolicy | None = None,
        probe_interval_s: float = 1.0,
        ready_probe_interval_s: float = 5.0,
        source: str = SOURCE,
        apply: Callable[[ReplicaStateChanged], None] | None = None,
    ) -> None:
        self._registry = registry
        self._failures = failures
        self._publisher = publisher
        self._probe = probe
        self.policy = policy or PenaltyPolicy()
        self._probe_interval_s = probe_interval_s
        self._ready_probe_interval_s = ready_probe_interval_s
        self._source = source
        self._apply = apply or _ignore
        self._not_before: dict[str, float] = {}
        self._next_ready_probe: dict[str, float] = {}
        self._streaks: set[tuple[str, int]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def observe(self, transition: Transition) -> None:
        """A folded transition: an `unhealthy` one starts the penalty before probes try the replica again."""
        after = transition.after
        if after.state is ReplicaState.UNHEALTHY:
            loop = asyncio.get_running_loop()
            self._not_before[after.replica_id] = loop.time() + (after.penalty_s or self.policy.base_s)

    def report(self, replica: Replica, outcome: Outcome, *, counts: bool) -> None:
        """A passive signal from a request; handled in the background so failover never waits on Redis."""
        key = (replica.replica_id, replica.attempt)
        if outcome == "ok":
            if key in self._streaks:
                self._streaks.discard(key)
                self._spawn(self._failures.clear(*key))
            return
        if counts:
            self._streaks.add(key)
            self._spawn(self._on_failure(replica, outcome))

    async def _on_failure(self, replica: Replica, outcome: Outcome) -> None:
        failures = await self._failures.add_failure(replica.replica_id, replica.attempt)
        current = self._registry.get(replica.replica_id)
        if current is None or current.attempt != replica.attempt or current.state is not ReplicaState.READY:
            return
        if self.policy.ejects(outcome, failures):
            penalty = self.policy.penalty_s(failures)
            reason = f"{failures} consecutive failure(s), last: {outcome}"
            await self.transition(current, ReplicaState.UNHEALTHY, signal="passive", reason=reason, penalty_s=penalty)

    async def transition(
        self, replica: Replica, state: ReplicaState, *, signal: Signal, reason: str, penalty_s: float | None = None
    ) -> bool:
        """Move a replica to `state` here and on the timeline, unless another router already claimed the change."""
        if not await self._failures.claim_transition(replica.replica_id, replica.attempt, replica.generation):
            return False
        event = transition_event(replica, state, signal=signal, reason=reason, penalty_s=penalty_s, source=self._source)
        self._apply(event)
        await self._publisher.publish(event)
        log.info(
            "replica state changed",
            replica=replica.replica_id,
            state=state.value,
            previous=replica.state.value,
            signal=signal,
            reason=reason,
        )
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Probe every `probe_interval_s` until `stop`."""
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                with contextlib.suppress(Exception):
                    await self.probe_round()
                await asyncio.wait({stopping}, timeout=self._probe_interval_s)
        finally:
            stopping.cancel()
            for task in list(self._tasks):
                task.cancel()

    async def probe_round(self) -> None:
        """Probe the replicas that are due: starting or penalised ones (to promote), ready ones (to catch death)."""
        now = asyncio.get_running_loop().time()
        due: list[Awaitable[None]] = []
        for replica in self._registry.all():
            if replica.endpoint is None:
                continue
            if replica.probe_may_promote and now >= self._not_before.get(replica.replica_id, 0.0):
                due.append(self._probe_to_promote(replica))
            elif replica.routable and now >= self._next_ready_probe.get(replica.replica_id, 0.0):
                self._next_ready_probe[replica.replica_id] = now + self._ready_probe_interval_s
                due.append(self._probe_ready(replica))
        if due:
            await asyncio.gather(*due, return_exceptions=True)

    async def _probe_to_promote(self, replica: Replica) -> None:
        assert replica.endpoint is not None  # noqa: S101 - filtered by the caller
        result = await self._probe(replica.endpoint)
        if result == "ok":
            await self.transition(replica, ReplicaState.READY, signal="probe", reason="health check passed")
            self._next_ready_probe[replica.replica_id] = (
                asyncio.get_running_loop().time() + self._ready_probe_interval_s
            )
        elif replica.state is ReplicaState.UNHEALTHY:
            failures = await self._failures.add_failure(replica.replica_id, replica.attempt)
            self._not_before[replica.replica_id] = asyncio.get_running_loop().time() + self.policy.penalty_s(failures)

    async def _probe_ready(self, replica: Replica) -> None:
        assert replica.endpoint is not None  # noqa: S101 - filtered by the caller
        result = await self._probe(replica.endpoint)
        if result != "ok":
            # An active probe that fails is decisive: the replica leaves rotation now.
            failures = await self._failures.add_failure(replica.replica_id, replica.attempt)
            current = self._registry.get(replica.replica_id)
            if current is not None and current.routable and current.attempt == replica.attempt:
                penalty = self.policy.penalty_s(max(failures, self.policy.failures_to_eject))
                await self.transition(
                    current, ReplicaState.UNHEALTHY, signal="probe", reason=f"health check: {result}", penalty_s=penalty
                )

    def _spawn(self, work: Awaitable[None]) -> None:
        async def guarded() -> None:
            try:
                await work
            except Exception as exc:  # noqa: BLE001 - a lost health signal must not kill the router
                log.warning("health bookkeeping failed", error=str(exc) or type(exc).__name__)

        task = asyncio.create_task(guarded())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _ignore(_event: ReplicaStateChanged) -> None:
    return None
