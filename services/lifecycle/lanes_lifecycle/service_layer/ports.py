"""What the lifecycle's handler needs from the outside world, as Protocols (adapters implement them)."""

from __future__ import annotations

from typing import Protocol

from lanes_contract.events import JobStateChanged
from lanes_lifecycle.domain.job import JobView


class JobRepository(Protocol):
    """The job views of the projection, inside the unit of work's transaction."""

    async def load(self, job_id: str) -> tuple[JobView | None, int]:
        """The job's view (locked for the transaction) and the log sequence of its last state change (0: none)."""
        ...

    async def save(self, view: JobView, *, transition_seq: int | None = None) -> None:
        """Store the view; keep the recorded state-change sequence unless `transition_seq` is given."""
        ...


class TransitionLog(Protocol):
    """The job's chain of state changes on the log, appended under per-job optimistic concurrency."""

    async def append(self, changed: JobStateChanged, *, after_seq: int) -> int:
        """Append `changed` only if the job's last state change is at `after_seq`; return its sequence.

        Raises a retryable error when another writer appended a different change first.
        """
        ...


class UnitOfWork(Protocol):
    """One transaction's view of the lifecycle's state: the repository and the transition log."""

    @property
    def jobs(self) -> JobRepository:
        """The job views, on this unit's transaction."""
        ...

    @property
    def transitions(self) -> TransitionLog:
        """The job's state-change chain on the log."""
        ...
