"""The lifecycle's ports on PostgreSQL (the consumer's open transaction) and JetStream."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
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
    """Job views in the lifecycle's tables, on the consumer's transaction, and their state changes on the log.

    A view is read (and locked) once per transaction and kept in the transaction's scope: the first read
    reads every job of the batch at once (the scope's keys). The views changed by a batch are written once,
    together, just before it commits, however many of each job's events it applied.

    So are the batch's state changes: each job's chain is appended in order, every job's at once, just before
    the rows are written (a round trip per state change, awaited one by one, was a sixth of a fold's time).
    When the batch is folded again event by event to settle a failure alone (an isolated scope), each change
    is appended by its own event, so that a refused append is that event's failure, not the batch's.
    """

    conn: Db
    scope: TransactionScope
    transitions: JetStreamTransitions
    parsed: repository.ParsedViews | None = None
    """Views parsed in earlier transactions, reused while their row is unchanged."""

    async def load(self, job_id: str) -> JobView | None:
        """The job's view, locked for the transaction."""
        key = (_CACHE, job_id)
        if key not in self.scope.cache:
            await self._read(job_id)
        cached: _Cached = self.scope.cache[key]
        return cached.view

    async def _read(self, job_id: str) -> None:
        read = {known[1] for known in self.scope.cache if isinstance(known, tuple) and known[0] == _CACHE}
        wanted = sorted({job_id, *self.scope.keys} - read)
        found = await repository.load_many(self.conn, wanted, self.parsed)
        for wanted_id in wanted:
            view, seq = found.get(wanted_id, (None, 0))
            self.scope.cache[_CACHE, wanted_id] = _Cached(view, seq, loaded=view)

    async def save(self, view: JobView, *, transition: JobStateChanged | None = None) -> None:
        """Keep the job's new view, and the state change that led to it, for this transaction.

        Both are written before the commit, the state change first.
        """
        key = (_CACHE, view.job_id)
        previous: _Cached | None = self.scope.cache.get(key)
        # Saved without being read: its stored rows are not known, so all are replaced.
        cached = previous or _Cached(None, 0, loaded=None, known=False)
        cached = dataclasses.replace(cached, view=view, dirty=True)
        if transition is not None:
            if self.scope.deferred and not self.scope.isolated:
                cached = dataclasses.replace(cached, unappended=(*cached.unappended, transition))
            else:
                cached = await cached.appended(self.transitions, (transition,))
        self.scope.cache[key] = cached
        if not self.scope.deferred:
            await repository.save_many(self.conn, [cached.saved()], self.parsed)
            self.scope.cache[key] = _Cached(view, cached.seq, loaded=view)  # what the rows now hold
            return
        if (_WRITE, None) not in self.scope.cache:
            self.scope.cache[_WRITE, None] = True
            self.scope.before_commit(self._write)

    async def _write(self) -> None:
        dirty = sorted(
            (c for c in self.scope.cache.values() if isinstance(c, _Cached) and c.dirty),
            key=lambda cached: cached.job_id,
        )
        chains = [cached.appended(self.transitions, cached.unappended) for cached in dirty]
        # Every chain runs to its end before a failure is raised: none is left publishing under a rollback.
        results = await asyncio.gather(*chains, return_exceptions=True)
        if failed := next((r for r in results if isinstance(r, BaseException)), None):
            raise failed
        appended = [r for r in results if isinstance(r, _Cached)]
        await repository.save_many(self.conn, [cached.saved() for cached in appended], self.parsed)


@dataclass(frozen=True)
class _Cached:
    view: JobView | None
    seq: int
    """The log sequence of the job's last appended state change (0: none yet)."""
    dirty: bool = False
    loaded: JobView | None = None
    """The view as this transaction read it: what the job's stored query rows were written from."""
    known: bool = True
    """False when the job was saved without being read (its stored rows are then not known)."""
    unappended: tuple[JobStateChanged, ...] = ()
    """State changes this transaction decided and has yet to append to the job's chain, in order."""

    @property
    def job_id(self) -> str:
        assert self.view is not None  # noqa: S101 - only saved views are dirty
        return self.view.job_id

    async def appended(self, transitions: JetStreamTransitions, changes: Sequence[JobStateChanged]) -> _Cached:
        """This entry once `changes` are appended to the job's chain, each right after the one before."""
        seq = self.seq
        for changed in changes:
            seq = await transitions.append(changed, after_seq=seq)
        return dataclasses.replace(self, seq=seq, unappended=())

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
    """The repository on the open transaction and the transition log it appends to; the consumer commits."""

    conn: Db
    transitions: JetStreamTransitions
    scope: TransactionScope = field(default_factory=TransactionScope)
    parsed: repository.ParsedViews | None = None
    jobs: PostgresJobs = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "jobs", PostgresJobs(self.conn, self.scope, self.transitions, self.parsed))
