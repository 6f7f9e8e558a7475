"""The lifecycle's ports on PostgreSQL (the consumer's open transaction) and JetStream."""

from __future__ import annotations

import dataclasses
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
    parsed: repository.ParsedViews | None = None
    """Views parsed in earlier transactions, reused while their row is unchanged."""

    async def load(self, job_id: str) -> tuple[JobView | None, int]:
        """The job's view, locked for the transaction, and its last state change's sequence."""
        key = (_CACHE, job_id)
        if key not in self.scope.cache:
            await self._read(job_id)
        cached: _Cached = self.scope.cache[key]
        return cached.view, cached.seq

    async def _read(self, job_id: str) -> None:
        read = {known[1] for known in self.scope.cache if isinstance(known, tuple) and known[0] == _CACHE}
        wanted = sorted({job_id, *self.scope.keys} - read)
        found = await repository.load_many(self.conn, wanted, self.parsed)
        for wanted_id in wanted:
            view, seq = found.get(wanted_id, (None, 0))
            self.scope.cache[_CACHE, wanted_id] = _Cached(view, seq, loaded=view)

    async def save(self, view: JobView, *, transition_seq: int | None = None) -> None:
        """Keep the job's new view for this transaction; it is written before the commit."""
        key = (_CACHE, view.job_id)
        previous: _Cached | None = self.scope.cache.get(key)
        seq = transition_seq if transition_seq is not None else (previous.seq if previous else 0)
        if previous is None:  # saved without being read: its stored rows are not known, so all are replaced
            self.scope.cache[key] = _Cached(view, seq, dirty=True, loaded=None, known=False)
        else:
            self.scope.cache[key] = dataclasses.replace(previous, view=view, seq=seq, dirty=True)
        if not self.scope.deferred:
            await repository.save_many(self.conn, [self.scope.cache[key].saved()], self.parsed)
            self.scope.cache[key] = _Cached(view, seq, loaded=view)  # what the rows now hold
            return
        if (_WRITE, None) not in self.scope.cache:
            self.scope.cache[_WRITE, None] = True
            self.scope.before_commit(self._write)

    async def _write(self) -> None:
        dirty = [c.saved() for c in self.scope.cache.values() if isinstance(c, _Cached) and c.dirty]
        await repository.save_many(self.conn, sorted(dirty, key=lambda saved: saved.view.job_id), self.parsed)


@dataclass(frozen=True)
class _Cached:
    view: JobView | None
    seq: int
    dirty: bool = False
    loaded: JobView | None = None
    """The view as this transaction read it: what the job's stored query rows were written from."""
    known: bool = True
    """False when the job was saved without being read (its stored rows are then not known)."""

    def saved(self) -> repository.SavedView:
        assert self.view is not None  # noqa: S101 - only saved views are dirty
        return repository.SavedView(self.view, self.seq, self.loaded, known_before=self.known)


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
    parsed: repository.ParsedViews | None = None
    jobs: PostgresJobs = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "jobs", PostgresJobs(self.conn, self.scope, self.parsed))
