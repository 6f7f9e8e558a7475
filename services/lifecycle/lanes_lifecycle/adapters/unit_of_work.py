"""The lifecycle's ports on PostgreSQL (the consumer's open transaction) and JetStream."""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.js import JetStreamContext

from lanes_contract.events import JobStateChanged
from lanes_lifecycle.adapters import repository
from lanes_lifecycle.adapters.transitions import publish_transition
from lanes_lifecycle.domain.job import JobView
from lanes_runtime.store import Db


@dataclass(frozen=True)
class PostgresJobs:
    """Job views in the lifecycle's tables, on the consumer's transaction."""

    conn: Db

    async def load(self, job_id: str) -> tuple[JobView | None, int]:
        """The job's view, locked for the transaction, and its last state change's sequence."""
        return await repository.load_with_seq(self.conn, job_id, for_update=True)

    async def save(self, view: JobView, *, transition_seq: int | None = None) -> None:
        """Insert or replace the job's rows."""
        await repository.save(self.conn, view, transition_seq=transition_seq)


@dataclass(frozen=True)
class JetStreamTransitions:
    """State changes appended to LANES_JOBS with the expected last subject sequence."""

    js: JetStreamContext

    async def append(self, changed: JobStateChanged, *, after_seq: int) -> int:
        """Append under the expected last subject sequence (see `publish_transition`)."""
        return await publish_transition(self.js, changed, after_seq=after_seq)


@dataclass(frozen=True)
class LifecycleUnitOfWork:
    """The repository on the open transaction and the transition log; the consumer commits."""

    conn: Db
    transitions: JetStreamTransitions
    jobs: PostgresJobs = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "jobs", PostgresJobs(self.conn))
