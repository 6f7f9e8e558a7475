"""What the lifecycle's handler needs from the outside world, as Protocols (adapters implement them)."""

from __future__ import annotations

from typing import Protocol

from lanes_contract.events import JobStateChanged
from lanes_lifecycle.domain.job import JobView


class JobRepository(Protocol):
    """The job views of the projection, inside the unit of work's transaction.

    Each job's chain of state changes on the log is saved with them.
    """

    async def load(self, job_id: str) -> JobView | None:
        """The job's view, locked for the transaction (None: no such job yet)."""
        ...

    async def save(self, view: JobView, *, transition: JobStateChanged | None = None) -> None:
        """Store the view; with `transition`, the state change that led to it, append that change first.

        The change goes on the job's chain on the log, right after the job's last one, before the transaction
        commits.

        Raises a retryable error when another writer appended a different change first: the projection is then
        rolled back with it, so the log and the projection never disagree.
        """
        ...


class UnitOfWork(Protocol):
    """One transaction's view of the lifecycle's state."""

    @property
    def jobs(self) -> JobRepository:
        """The job views and their state-change chains, on this unit's transaction."""
        ...
