"""What recovery's handlers need from the outside world, as Protocols (cosmicpython's ports).

The handlers take a `RecoveryStore` opened on the consumer's (or the timer's) transaction, and a digest
checker; PostgreSQL implements the store in `adapters/repository.py`, the unit tests an in-memory fake.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Protocol

from lanes_contract.events import RecoveryDecided
from lanes_recovery.domain.checkpoints import DigestVerdict
from lanes_recovery.domain.knowledge import JobKnowledge, SavedCheckpoint
from lanes_runtime.store import Db


class RecoveryStore(Protocol):
    """Recovery's state for one transaction: the knowledge per job and the decisions it published."""

    async def lock_new(self, job_id: str) -> None:
        """Make sure the job has a row to lock."""
        ...

    async def load(self, job_id: str) -> JobKnowledge | None:
        """The job's knowledge, locked for this transaction."""
        ...

    async def claim_due(self, job_id: str, now: datetime) -> JobKnowledge | None:
        """The job's knowledge if its timer is due and no other process holds it."""
        ...

    async def save(self, knowledge: JobKnowledge, next_due_at: datetime | None) -> None:
        """Store the job's knowledge and its next timer."""
        ...

    async def record_decision(self, decided: RecoveryDecided) -> None:
        """Keep a published decision (one policy decision in force per attempt)."""
        ...

    async def mark_superseded(self, decision_id: str, by: str) -> None:
        """Note that a later decision (or escalation) replaced this one."""
        ...

    async def mark_escalated(self, decision_id: str, at: datetime) -> None:
        """Note that a manual decision's deadline passed and was escalated."""
        ...

    async def cordoned_since(self, since: datetime) -> frozenset[str]:
        """The nodes cordoned by decisions in force made since `since` (any job), held still until the commit.

        Two decisions counting against the cordon budget at once must not both take its last place.
        """
        ...


StoreFactory = Callable[[Db], RecoveryStore]
"""Opens the store on a transaction's connection."""


class Digests(Protocol):
    """Recomputes checkpoint digests off the critical path: a verdict per (path, digest)."""

    def start(self, checkpoints: Sequence[SavedCheckpoint]) -> None:
        """Start computing these verdicts in the background (a decision will ask for them soon)."""
        ...

    def ready(self, checkpoints: Sequence[SavedCheckpoint]) -> Mapping[tuple[str, str], DigestVerdict] | None:
        """The verdicts if all are in, else None (and the missing ones are being computed)."""
        ...

    async def wait(self, checkpoints: Sequence[SavedCheckpoint]) -> Mapping[tuple[str, str], DigestVerdict]:
        """The verdicts, waiting (bounded) for those still being computed."""
        ...
