"""What-if by replay: recovery's real handlers run over a recorded job log under another policy.

The replay feeds the events recovery's consumer reads (`RECOVERY_INPUTS`), in log order, to the same
`Recovery` handler the service runs, on the in-memory store (`adapters/memory.py`). Its clock is each event's
recorded time (never going back: a producer's clock may lag the one before it), except where the log shows the
very moment the recorded recovery acted: a decision carries the time its handler read, and its id derives from
what it answers (the state change that ended the attempt, the owner's action), never from the policy. So a call
that makes a decision the log also holds is run again at the recorded decision's time, and a deadline the
decision computes from "now" comes out as recorded instead of early by the recorded processing delay.

Recovery's timers (a finding's grace, a retry's backoff, a manual deadline) fire at their due time once
replay time passes it, and only up to the last recorded event: what would have fired after the log ends
never happened in the recorded past either, so it has nothing to be compared with.

Checkpoint digests cannot be recomputed from a log: `RecordedDigests` gives each checkpoint the verdict the
recorded decisions imply (refused for its digest, else matching). The result says so.

The decisions the handler makes are compared with the `recovery_decided` events of the log, per job and
attempt in the order they were made: a decision differs when its action, reason, owner or cordons do.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

from lanes_contract.events import (
    CancelRequested,
    Event,
    RecoveryAction,
    RecoveryDecided,
    RecoveryEscalated,
    ResumeRequested,
    RetryRequested,
)
from lanes_recovery.adapters.memory import MemoryRecoveryStore, RecordedDigests
from lanes_recovery.domain.policy import Policy
from lanes_recovery.entrypoints.service import RECOVERY_INPUTS
from lanes_recovery.entrypoints.whatif_outcomes import OUTCOME_TREATMENT, Side, outcome_deltas, recorded_side
from lanes_recovery.service_layer.handlers import Recovery
from lanes_runtime.consumer import HandlerContext
from lanes_runtime.store import Db

RETRYING = frozenset({RecoveryAction.RESUME, RecoveryAction.REBUILD, RecoveryAction.REPLACE_REPLICA})
"""Actions that start a new attempt: what the deltas count as retries."""
_NO_CONNECTION = cast("Db", None)
"""The handlers pass their connection to the store factory only; the in-memory store ignores it."""
_MAX_TIMER_FIRINGS = 1_000
"""Timer firings of one job at one moment before the replay stops looping on it (a timer that never moves on)."""
DIGEST_TREATMENT = (
    "checkpoint digests are not recomputed: a checkpoint a recorded decision refused for its digest is a "
    "mismatch, every other one is taken as matching its record"
)
TALLIED = ("retries", "cordons", "pages")
TIMER_TREATMENT = (
    "the clock is each event's recorded time (a recorded decision's own time when the log holds it); recovery's "
    "timers fire at their due time, up to the last recorded event"
)


@dataclass(frozen=True)
class Decision:
    """What one decision did, as the diff compares it."""

    action: str
    reason: str
    owner: str
    cordon: tuple[str, ...]
    manual_action: str | None

    @classmethod
    def of(cls, decided: RecoveryDecided) -> Decision:
        """The compared parts of a `recovery_decided` event."""
        data = decided.data
        manual = None if data.manual_action is None else data.manual_action.value
        return cls(data.action.value, data.reason, data.owner, tuple(data.cordon), manual)

    def as_json(self) -> dict[str, Any]:
        """The decision in the `--json` diff."""
        return {
            "action": self.action,
            "reason": self.reason,
            "owner": self.owner,
            "cordon": list(self.cordon),
            "manual_action": self.manual_action,
        }


@dataclass(frozen=True)
class DecisionChange:
    """One decision (job, attempt, its place among the attempt's decisions) recorded one way, replayed another."""

    job_id: str
    attempt: int
    recorded: Decision | None
    new: Decision | None

    @property
    def reason(self) -> str:
        """Why the new policy decides as it does (or that it made no such decision)."""
        if self.new is None:
            return "the new policy made no such decision (the recorded one answered an attempt it did not fail)"
        return self.new.reason

    def as_json(self) -> dict[str, Any]:
        """`{"job_id", "attempt", "recorded", "new", "reason"}`."""
        return {
            "job_id": self.job_id,
            "attempt": self.attempt,
            "recorded": None if self.recorded is None else self.recorded.as_json(),
            "new": None if self.new is None else self.new.as_json(),
            "reason": self.reason,
        }


@dataclass
class Tally:
    """Retries, cordons and pages (manual decisions and escalations) of one owner, or of everyone."""

    retries: int = 0
    cordons: int = 0
    pages: int = 0

    def count(self, decided: RecoveryDecided) -> None:
        """Add one decision."""
        self.retries += decided.data.action in RETRYING
        self.cordons += len(decided.data.cordon)
        self.pages += decided.data.action is RecoveryAction.MANUAL


@dataclass(frozen=True)
class WhatIf:
    """The result of one recovery what-if: the decision diff and the deltas."""

    policy: str
    policy_version: int
    events: int
    """Events in the log."""
    replayed: int
    """Events recovery's consumer reads, fed to the handler."""
    recorded: tuple[RecoveryDecided, ...]
    new: tuple[RecoveryDecided, ...]
    escalations: tuple[Counter[str], Counter[str]]
    """Escalations per owner: (recorded, new); an escalation pages its owner too."""
    diff: tuple[DecisionChange, ...]
    horizon: datetime | None
    """The last recorded event's time: timers due later were not fired."""
    digests_mismatched: int
    outcomes: dict[str, Any] = field(default_factory=dict)
    """GPU-hours held while waiting, time to recover, resumes the version gate refused (`whatif_outcomes`)."""
    treatment: tuple[str, ...] = field(default=(DIGEST_TREATMENT, TIMER_TREATMENT, OUTCOME_TREATMENT))

    def deltas(self) -> dict[str, Any]:
        """Retries, cordons and pages per owner, and the outcomes (GPU-hours waiting, recovery time, gate refusals).

        Pages include escalations; the outcomes are `whatif_outcomes.outcome_deltas`.
        """
        per_owner: dict[str, dict[str, Tally]] = {}
        totals = {"recorded": Tally(), "new": Tally()}
        for side, decisions, escalated in (
            ("recorded", self.recorded, self.escalations[0]),
            ("new", self.new, self.escalations[1]),
        ):
            for decided in decisions:
                owner = per_owner.setdefault(decided.data.owner, {"recorded": Tally(), "new": Tally()})
                owner[side].count(decided)
                totals[side].count(decided)
            for name, pages in escalated.items():
                per_owner.setdefault(name, {"recorded": Tally(), "new": Tally()})[side].pages += pages
                totals[side].pages += pages

        def compared(tallies: dict[str, Tally]) -> dict[str, dict[str, int]]:
            counts = {what: (getattr(tallies["recorded"], what), getattr(tallies["new"], what)) for what in TALLIED}
            return {what: {"recorded": old, "new": new, "delta": new - old} for what, (old, new) in counts.items()}

        return {
            **compared(totals),
            "by_owner": {owner: compared(tallies) for owner, tallies in sorted(per_owner.items())},
            **self.outcomes,
        }

    def as_json(self) -> dict[str, Any]:
        """`lanes whatif recovery --json`: the diff, the deltas and what the replay covered."""
        return {
            "diff": [change.as_json() for change in self.diff],
            "deltas": self.deltas(),
            "replay": {
                "policy": self.policy,
                "policy_version": self.policy_version,
                "events": self.events,
                "replayed": self.replayed,
                "decisions_recorded": len(self.recorded),
                "decisions_replayed": len(self.new),
                "horizon": None if self.horizon is None else self.horizon.isoformat(),
                "digests": DIGEST_TREATMENT,
                "digests_mismatched": self.digests_mismatched,
                "timers": TIMER_TREATMENT,
                "outcomes": OUTCOME_TREATMENT,
            },
        }


class _Replay:
    """One replay: the handler on the in-memory store, the clock it reads, what it published."""

    def __init__(self, policy: Policy, recorded: Sequence[RecoveryDecided]) -> None:
        self.store = MemoryRecoveryStore()
        self.digests = RecordedDigests(recorded)
        self.now: datetime | None = None
        self.recovery = Recovery(lambda: policy, digests=self.digests, clock=self._clock, store=self.store)
        self.published: list[tuple[Event, datetime]] = []
        """What the handler published, each at the replay clock's time (a retry's own `time` is the wall clock)."""
        self.fed = 0
        self._recorded_at = {decided.id: decided.time for decided in recorded}

    def _clock(self) -> datetime:
        assert self.now is not None  # noqa: S101 - the handler runs only after an event set the clock
        return self.now

    def _advance(self, to: datetime) -> None:
        self.now = to if self.now is None else max(self.now, to)

    async def fire_timers(self, until: datetime) -> None:
        """Fire every timer due at or before `until`, earliest first, each at its own due time."""
        fired: Counter[tuple[str, datetime]] = Counter()
        while (due := self.store.next_due()) is not None and due[0] <= until:
            when, job_id = due
            fired[job_id, when] += 1
            if fired[job_id, when] > _MAX_TIMER_FIRINGS:
                self.store.due.pop(job_id)  # a timer that does not move on would loop forever; drop it
                continue
            await self._call(when, functools.partial(self._on_timer, job_id))

    async def _on_timer(self, job_id: str, now: datetime) -> Sequence[Event]:
        return await self.recovery.on_timer(_NO_CONNECTION, job_id, now)

    async def feed(self, event: Event) -> None:
        """Fire the timers due before the event, then hand it to the consumer's handler at its recorded time."""
        await self.fire_timers(event.time)
        self.fed += 1
        ctx = HandlerContext(conn=_NO_CONNECTION, stream_seq=self.fed, deliveries=1)
        await self._call(event.time, lambda _now: self.recovery.handle_job_event(event, ctx))

    async def _call(self, at: datetime, call: Callable[[datetime], Awaitable[Sequence[Event]]]) -> None:
        """Run one handler call at `at`; again at the recorded decision's time when it makes a recorded decision."""
        self._advance(at)
        assert self.now is not None  # noqa: S101 - just set
        self.store.begin()
        outputs = await call(self.now)
        recorded_at = next(
            (self._recorded_at[e.id] for e in outputs if isinstance(e, RecoveryDecided) and e.id in self._recorded_at),
            None,
        )
        if recorded_at is not None and recorded_at != self.now:
            self.store.rollback()
            self.now = recorded_at  # the recorded handler's "now", even if a producer's clock ran ahead of it
            self.store.begin()
            outputs = await call(self.now)
        self.store.commit()
        self.published.extend((output, self.now) for output in outputs)


def _diff(recorded: Iterable[RecoveryDecided], new: Iterable[RecoveryDecided]) -> tuple[DecisionChange, ...]:
    """Pair the decisions of each job and attempt in the order they were made; keep the pairs that differ."""
    sides: dict[tuple[str, int], tuple[list[Decision], list[Decision]]] = {}
    for index, decisions in enumerate((recorded, new)):
        for decided in decisions:
            key = (decided.job_key, decided.attempt or 1)
            sides.setdefault(key, ([], []))[index].append(Decision.of(decided))
    changes: list[DecisionChange] = []
    for (job_id, attempt), (old, now) in sides.items():
        for position in range(max(len(old), len(now))):
            before = old[position] if position < len(old) else None
            after = now[position] if position < len(now) else None
            if before != after:
                changes.append(DecisionChange(job_id, attempt, before, after))
    return tuple(changes)


async def replay_recovery(events: Sequence[Event], policy: Policy) -> WhatIf:
    """Replay a recorded job log through recovery's handlers under `policy`; diff its decisions with the log's."""
    recorded = tuple(e for e in events if isinstance(e, RecoveryDecided))
    recorded_escalations = Counter(e.data.owner for e in events if isinstance(e, RecoveryEscalated))
    replay = _Replay(policy, recorded)
    horizon: datetime | None = None
    for event in events:
        horizon = event.time if horizon is None else max(horizon, event.time)
        if type(event).name in RECOVERY_INPUTS:
            await replay.feed(event)
    if horizon is not None:
        await replay.fire_timers(horizon)
    new = tuple(e for e, _at in replay.published if isinstance(e, RecoveryDecided))
    new_escalations = Counter(e.data.owner for e, _at in replay.published if isinstance(e, RecoveryEscalated))
    new_side = Side(
        decisions=[(e, at) for e, at in replay.published if isinstance(e, RecoveryDecided)],
        requests=[(e, at) for e, at in replay.published if isinstance(e, RetryRequested | ResumeRequested)],
        abandons=[(e, at) for e, at in replay.published if isinstance(e, CancelRequested)],
    )
    return WhatIf(
        policy=policy.name,
        policy_version=policy.version,
        events=len(events),
        replayed=replay.fed,
        recorded=recorded,
        new=new,
        escalations=(recorded_escalations, new_escalations),
        diff=_diff(recorded, new),
        horizon=horizon,
        digests_mismatched=replay.digests.mismatched,
        outcomes=outcome_deltas(events, recorded_side(events), new_side),
    )
