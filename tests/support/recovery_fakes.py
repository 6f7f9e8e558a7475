"""An in-memory `RecoveryStore` (the port recovery's handlers take), for handler unit tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from lanes_contract.events import RecoveryDecided
from lanes_recovery.domain.checkpoints import NOT_CHECKED, DigestVerdict, digest_key
from lanes_recovery.domain.knowledge import JobKnowledge, SavedCheckpoint
from lanes_recovery.service_layer.ports import RecoveryStore


class InMemoryRecoveryStore:
    """Knowledge, timers and decisions in dicts; enforces the one-policy-decision-in-force rule like the index."""

    def __init__(self) -> None:
        self.knowledge: dict[str, JobKnowledge] = {}
        self.due: dict[str, datetime | None] = {}
        self.decisions: dict[str, RecoveryDecided] = {}
        self.superseded_by: dict[str, str] = {}
        self.escalated: dict[str, datetime] = {}

    def __call__(self, _conn: Any) -> RecoveryStore:
        """The store factory: every transaction sees the same dicts (the tests run one at a time)."""
        return self

    async def lock_new(self, job_id: str) -> None:
        self.knowledge.setdefault(job_id, JobKnowledge(job_id=job_id))

    async def load(self, job_id: str) -> JobKnowledge | None:
        return self.knowledge.get(job_id)

    async def claim_due(self, job_id: str, now: datetime) -> JobKnowledge | None:
        due = self.due.get(job_id)
        return self.knowledge[job_id] if due is not None and due <= now else None

    async def save(self, knowledge: JobKnowledge, next_due_at: datetime | None) -> None:
        self.knowledge[knowledge.job_id] = knowledge
        self.due[knowledge.job_id] = next_due_at

    async def record_decision(self, decided: RecoveryDecided) -> None:
        if decided.data.manual_action is None:
            clash = [
                d
                for d in self.decisions.values()
                if d.job_key == decided.job_key and d.attempt == decided.attempt and d.data.manual_action is None
                and d.id not in self.superseded_by
            ]  # fmt: skip
            assert not clash, f"a second policy decision in force for attempt {decided.attempt}"
        self.decisions[decided.id] = decided

    async def mark_superseded(self, decision_id: str, by: str) -> None:
        self.superseded_by[decision_id] = by

    async def mark_escalated(self, decision_id: str, at: datetime) -> None:
        self.escalated[decision_id] = at

    async def cordoned_since(self, since: datetime) -> frozenset[str]:
        return frozenset(
            node
            for d in self.decisions.values()
            if d.time >= since and d.id not in self.superseded_by
            for node in d.data.cordon
        )


class FakeDigests:
    """The `Digests` port: every checkpoint unchecked, except paths held back as "still being hashed"."""

    def __init__(self) -> None:
        self.hashing: set[str] = set()

    def start(self, checkpoints: Sequence[SavedCheckpoint]) -> None:
        del checkpoints

    def ready(self, checkpoints: Sequence[SavedCheckpoint]) -> Mapping[tuple[str, str], DigestVerdict] | None:
        if any(c.path in self.hashing for c in checkpoints):
            return None
        return {digest_key(c): NOT_CHECKED for c in checkpoints}

    async def wait(self, checkpoints: Sequence[SavedCheckpoint]) -> Mapping[tuple[str, str], DigestVerdict]:
        self.hashing.clear()
        return {digest_key(c): NOT_CHECKED for c in checkpoints}
