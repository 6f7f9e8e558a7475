"""What the service layer needs from the outside world, as protocols the adapters implement."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from lanes_contract.events import Event
from lanes_router.domain.routing import Lease


class SharedStateUnavailableError(Exception):
    """The shared store did not answer in time (down, stopped, partitioned): the request cannot be counted."""


class LeaseStore(Protocol):
    """Concurrency slots shared by every router (Redis in production)."""

    async def acquire(self, replica_ids: Sequence[str], caps: Sequence[int]) -> Lease | None:
        """A slot on one of the candidates (power of two among the first two), or None when all are full.

        Raises SharedStateUnavailableError, within a bounded time, when the store does not answer.
        """
        ...

    async def check(self) -> bool:
        """Whether the store answers now (bounded in time); readiness follows it."""
        ...

    def release(self, lease: Lease) -> None:
        """Give a slot back (asynchronously)."""
        ...


class EventPublisher(Protocol):
    """Publishes one event on the timeline and waits for JetStream to store it."""

    async def publish(self, event: Event) -> int:
        """The stream sequence of the stored event."""
        ...


class FailureCounter(Protocol):
    """Consecutive failures of a replica attempt, counted by all routers together."""

    async def add_failure(self, replica_id: str, attempt: int) -> int:
        """Count one failure; return the consecutive count."""
        ...

    async def clear(self, replica_id: str, attempt: int) -> None:
        """A success: the count starts again."""
        ...

    async def claim_transition(self, replica_id: str, attempt: int, generation: int) -> bool:
        """Whether this router is the one that publishes the replica's next state change (first caller wins)."""
        ...
