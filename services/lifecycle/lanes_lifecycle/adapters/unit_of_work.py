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

    A view is read (and locked) once per transaction and kept in the transaction's scope: the first read
    reads every job of the batch at once (the scope's keys). The views changed by a batch are written once,
    together, just before it commits, however many of each job's events it applied.
    """

    conn: Db
    scope: TransactionScope

    async def load(self, job_id: str) -> tuple[JobView | None, int]:
        """The job's view, locked for the transaction, and its last state change's sequence."""
        key = (_CACHE, job_id)
        if key not in self.scope.cache:
            read = {known[1] for known in self.scope.cache if isinstance(known, tuple) and known[0] == _CACHE}
            wanted = sorted({job_id, *self.scope.keys} - read)
            found = await repository.load_many(self.conn, wanted)
            for wanted_id in wanted:
                view, seq = found.get(wanted_id, (None, 0))
                self.scope.cache[_CACHE, wanted_id] = _Cached(view, seq)
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
        if (_WRITE, None) not in self.scope.cache:
            self.scope.cache[_WRITE, None] = True
            self.scope.before_commit(self._write)

    async def _write(self) -> None:
        dirty = [
            (c.view, c.seq)
            for c in self.scope.cache.values()
            if isinstance(c, _Cached) and c.dirty and c.view is not None
        ]
        await repository.save_many(self.conn, sorted(dirty, key=lambda changed: changed[0].job_id))


@dataclass(frozen=True)
class _Cached:
    view: JobView | None
    seq: int
    dirty: bool = False


_CACHE = "lifecycle-jobs"
_WRITE = "lifecycle-write"


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
