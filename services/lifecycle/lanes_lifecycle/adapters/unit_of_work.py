"""The lifecycle's ports on PostgreSQL (the consumer's open transaction) and JetStream."""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.js import JetStreamContext

from lanes_contract.events import JobStateChanged
from lanes_lifecycle.adapters import repository
from lanes_lifecycle.adapters.transitions import publish_transition
from lanes_lifecycle.domain.job import JobView
from lanes_runtime.consumer import TransactionScope
from lanes_runtime.store import Db


@dataclass(frozen=True)
class PostgresJobs:
    """Job views in the lifecycle's tables, on the consumer's transaction.

    A view is read (and locked) once per transaction and kept in the transaction's scope; the views changed
    by a batch are written once, just before it commits, however many of the job's events it applied.
    """

    conn: Db
    scope: TransactionScope

    async def load(self, job_id: str) -> tuple[JobView | None, int]:
        """The job's view, locked for the transaction, and its last state change's sequence."""
        key = (_CACHE, job_id)
        if key not in self.scope.cache:
            view, seq = await repository.load_with_seq(self.conn, job_id, for_update=True)
            self.scope.cache[key] = _Cached(view, seq)
        cached: _Cached = self.scope.cache[key]
        return cached.view, cached.seq

    async def save(self, view: JobView, *, transition_seq: int | None = None) -> None:
        """Keep the job's new view for this transaction; it is written before the commit."""
        key = (_CACHE, view.job_id)
        previous: _Cached | None = self.scope.cache.get(key)
        seq = transition_seq if transition_seq is not None else (previous.seq if previous else 0)
        self.scope.cache[key] = _Cached(view, seq, dirty=True)
        if not self.scope.deferred:
            await repository.save(self.conn, view, transition_seq=seq)
            return
        if (_CACHE, None) not in self.scope.cache:
            self.scope.cache[_CACHE, None] = True
            self.scope.before_commit(self._write)

    async def _write(self) -> None:
        for cached in self.scope.cache.values():
            if isinstance(cached, _Cached) and cached.dirty and cached.view is not None:
                await repository.save(self.conn, cached.view, transition_seq=cached.seq)


@dataclass(frozen=True)
class _Cached:
    view: JobView | None
    seq: int
    dirty: bool = False


_CACHE = "lifecycle-jobs"


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
    scope: TransactionScope = field(default_factory=TransactionScope)
    jobs: PostgresJobs = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "jobs", PostgresJobs(self.conn, self.scope))
