"""Recovery's store and digest ports held in memory, for a replay of the recorded past (`lanes whatif recovery`).

A what-if runs the real handlers (`service_layer/handlers.py`) over a recorded log without PostgreSQL or a
checkpoint file system. The store keeps what the PostgreSQL tables keep (the knowledge per job, its next timer,
every published decision), with the same rules: one policy decision in force per attempt, and the cordon
budget counting the decisions in force of every job. One replay runs one handler call at a time, so no lock
is needed; the same object serves as every "transaction's" store.

The digests cannot be recomputed (the files are elsewhere, or gone), so `RecordedDigests` answers with the
verdict the recorded decisions imply: a checkpoint a recorded decision refused for its digest is a mismatch
(with the digest it found), every other checkpoint is taken as matching its record.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from lanes_contract.events import RecoveryDecided
from lanes_recovery.domain.checkpoints import DigestVerdict, digest_key
from lanes_recovery.domain.knowledge import JobKnowledge, SavedCheckpoint
from lanes_recovery.service_layer.ports import RecoveryStore
from lanes_runtime.store import Db

_ABSENT = object()
"""What the journal remembers for a key that did not exist before the write."""


class DecisionClashError(RuntimeError):
    """A second policy decision in force for one attempt: what the unique index refuses in PostgreSQL."""


class MemoryRecoveryStore:
    """The `RecoveryStore` port in dicts: knowledge, next timers, decisions, supersessions and escalations."""

    def __init__(self) -> None:
        self.knowledge: dict[str, JobKnowledge] = {}
        self.due: dict[str, datetime] = {}
        self.decisions: dict[str, RecoveryDecided] = {}
        """Every decision recorded, in the order it was made (dicts keep insertion order)."""
        self.superseded_by: dict[str, str] = {}
        self.escalated: dict[str, datetime] = {}
        # Indexes, so a decision costs the same in a log of a million events as in a short one: the policy
        # decision in force per (job, attempt), and the decisions that cordon, in the order they were made.
        self._in_force: dict[tuple[str, int | None], str] = {}
        self._cordoning: dict[str, RecoveryDecided] = {}
        self._in_time_order = True
        """Whether the cordoning decisions were made in time order (a rerun at a recorded time can break it)."""
        self._journal: list[tuple[dict[Any, Any], Any, object]] | None = None

    def __call__(self, conn: Db | None) -> RecoveryStore:
        """The store factory the handlers take: the connection is ignored, every call sees the same state."""
        del conn
        return self

    def begin(self) -> None:
        """Start a transaction: every write until `commit` or `rollback` is journaled so it can be undone."""
        self._journal = []

    def commit(self) -> None:
        """Keep the writes since `begin`."""
        self._journal = None

    def rollback(self) -> None:
        """Undo the writes since `begin`, newest first, as PostgreSQL would roll the transaction back.

        A journal of the writes, not a copy of the state: undoing costs what the call wrote, not the size of
        every job's knowledge, so a replay of a long log stays linear.
        """
        for table, key, before in reversed(self._journal or []):
            if before is _ABSENT:
                table.pop(key, None)
            else:
                table[key] = before
        self._journal = None

    def _write(self, table: dict[Any, Any], key: Any, value: object) -> None:
        if self._journal is not None:
            self._journal.append((table, key, table.get(key, _ABSENT)))
        table[key] = value

    def _delete(self, table: dict[Any, Any], key: Any) -> None:
        if key in table:
            if self._journal is not None:
                self._journal.append((table, key, table[key]))
            del table[key]

    def next_due(self) -> tuple[datetime, str] | None:
        """The earliest pending timer: (when, job), or None when no job waits for one."""
        return min(((when, job_id) for job_id, when in self.due.items()), default=None)

    async def lock_new(self, job_id: str) -> None:
        """See `RecoveryStore.lock_new`."""
        if job_id not in self.knowledge:
            self._write(self.knowledge, job_id, JobKnowledge(job_id=job_id))

    async def load(self, job_id: str) -> JobKnowledge | None:
        """See `RecoveryStore.load`."""
        return self.knowledge.get(job_id)

    async def claim_due(self, job_id: str, now: datetime) -> JobKnowledge | None:
        """See `RecoveryStore.claim_due`."""
        due = self.due.get(job_id)
        return self.knowledge.get(job_id) if due is not None and due <= now else None

    async def save(self, knowledge: JobKnowledge, next_due_at: datetime | None) -> None:
        """See `RecoveryStore.save`."""
        self._write(self.knowledge, knowledge.job_id, knowledge)
        if next_due_at is None:
            self._delete(self.due, knowledge.job_id)
        else:
            self._write(self.due, knowledge.job_id, next_due_at)

    async def record_decision(self, decided: RecoveryDecided) -> None:
        """See `RecoveryStore.record_decision`; a second policy decision in force for an attempt is refused."""
        if decided.data.manual_action is None:
            key = (decided.job_key, decided.attempt)
            if key in self._in_force:
                msg = f"job {decided.job_key} attempt {decided.attempt}: a second policy decision in force"
                raise DecisionClashError(msg)
            self._write(self._in_force, key, decided.id)
        if decided.data.cordon:
            newest = next(reversed(self._cordoning.values()), None)
            self._in_time_order &= newest is None or newest.time <= decided.time
            self._write(self._cordoning, decided.id, decided)
        self._write(self.decisions, decided.id, decided)

    async def mark_superseded(self, decision_id: str, by: str) -> None:
        """See `RecoveryStore.mark_superseded`."""
        self._write(self.superseded_by, decision_id, by)
        decided = self.decisions.get(decision_id)
        if decided is not None and self._in_force.get((decided.job_key, decided.attempt)) == decision_id:
            self._delete(self._in_force, (decided.job_key, decided.attempt))

    async def mark_escalated(self, decision_id: str, at: datetime) -> None:
        """See `RecoveryStore.mark_escalated`."""
        self._write(self.escalated, decision_id, at)

    async def cordoned_since(self, since: datetime) -> frozenset[str]:
        """See `RecoveryStore.cordoned_since` (the decision's time is when it was decided).

        Newest first, stopping at the first decision older than `since` while they were made in time order (as
        a replay makes them, unless a call re-run at a recorded time went back): only the window's are read.
        """
        nodes: set[str] = set()
        for decided in reversed(self._cordoning.values()):
            if decided.time < since:
                if self._in_time_order:
                    break
                continue
            if decided.id not in self.superseded_by:
                nodes.update(decided.data.cordon)
        return frozenset(nodes)


class RecordedDigests:
    """The `Digests` port answered from the recorded decisions instead of the checkpoint files.

    Only a digest refusal leaves a trace in the log (a decision's `refused` entry with field `digest`); any
    checkpoint without one matched when it was checked, or was never checked because no decision needed it.
    """

    def __init__(self, decisions: Iterable[RecoveryDecided]) -> None:
        self._mismatched: dict[tuple[str, str], str | None] = {}
        for decided in decisions:
            for refused in decided.data.refused:
                if refused.field == "digest":
                    ref = refused.checkpoint
                    self._mismatched[ref.path, ref.digest] = refused.found

    @property
    def mismatched(self) -> int:
        """How many checkpoint records the log shows refused for their digest."""
        return len(self._mismatched)

    def verdict(self, checkpoint: SavedCheckpoint) -> DigestVerdict:
        """The verdict the log implies for one checkpoint record."""
        key = digest_key(checkpoint)
        if key in self._mismatched:
            return DigestVerdict(checked=True, matches=False, found=self._mismatched[key])
        return DigestVerdict(checked=True, matches=True, found=checkpoint.digest)

    def start(self, checkpoints: Sequence[SavedCheckpoint]) -> None:
        """See `Digests.start`: nothing to compute."""
        del checkpoints

    def ready(self, checkpoints: Sequence[SavedCheckpoint]) -> Mapping[tuple[str, str], DigestVerdict] | None:
        """See `Digests.ready`: always ready, so a replayed decision never waits on a digest recheck timer."""
        return {digest_key(c): self.verdict(c) for c in checkpoints}

    async def wait(self, checkpoints: Sequence[SavedCheckpoint]) -> Mapping[tuple[str, str], DigestVerdict]:
        """See `Digests.wait`."""
        return {digest_key(c): self.verdict(c) for c in checkpoints}
