"""What a recovery what-if's decisions cost: GPU-hours waiting, time to recover, resumes the version gate refused.

Derived, for each side (recorded and new), from the recorded log's own timestamps and the side's decisions:

- A failed attempt (its `state_changed` to `failed`) that a decision answered waits from that moment until the
  job runs again (its next attempt placed), is abandoned (recovery's `cancel_requested`), or the log ends.
- **Time to recover**: failure to the next attempt's placement. On the recorded side both come from the log.
  On the new side the retry request is the replay's own, at its replay-clock time, or at the recorded time when
  the log holds the same request (same derived id: the timer that sent it ticks later than its due time, and the
  replay fires it at the due time); what the scheduler took from a
  retry request to the placement cannot be replayed by recovery, so it is the recorded delay of the same
  attempt's retry when the log has one, else the median of the log's recorded delays (counted as
  `placement_delay_borrowed`), else unknown (the attempt counts as not recovered).
  A placement after the log's last event never happened in the recorded past: not recovered.
- **GPU-hours held while waiting**: the failed attempt's GPUs (its placement) times that wait.
- **Resumes the version gate refused**: training decisions whose checkpoint gate refused a record newer
  than the step they resume from (or every record), by the field it refused (model_version, digest, ...).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from lanes_contract.events import (
    CancelRequested,
    Event,
    JobPlaced,
    JobStateChanged,
    RecoveryAction,
    RecoveryDecided,
    ResumeRequested,
    RetryRequested,
)
from lanes_contract.jobs import JobState, WorkloadClass
from lanes_recovery.domain.decisions import RECOVERY

_SECONDS_PER_HOUR = 3600.0
OUTCOME_TREATMENT = (
    "a failed attempt waits from its failure until its next attempt is placed, it is abandoned, or the log ends; "
    "the new side's retry request is the replay's (at the recorded time when the log holds the same request), "
    "and the scheduler's delay from request to placement is the "
    "recorded one of the same attempt (else the log's median recorded delay); GPU-hours are the failed attempt's "
    "GPUs times that wait"
)

Attempt = tuple[str, int]
"""(job id, attempt number)."""


@dataclass(frozen=True)
class Side:
    """One side's recovery actions with the time each took effect (recorded: the log's; new: the replay clock's)."""

    decisions: Sequence[tuple[RecoveryDecided, datetime]]
    requests: Sequence[tuple[RetryRequested | ResumeRequested, datetime]]
    """Retry and resume requests recovery published, per failed attempt."""
    abandons: Sequence[tuple[CancelRequested, datetime]]
    """Cancels recovery published (an owner abandoned the job)."""


@dataclass(frozen=True)
class LogFacts:
    """What the recorded log says about attempts, whatever the policy."""

    failed_at: dict[Attempt, datetime]
    placed_at: dict[Attempt, datetime]
    gpus: dict[Attempt, int]
    horizon: datetime | None

    @classmethod
    def of(cls, events: Iterable[Event]) -> LogFacts:
        """Failures, placements and GPU counts per attempt, and the last event's time."""
        failed_at: dict[Attempt, datetime] = {}
        placed_at: dict[Attempt, datetime] = {}
        gpus: dict[Attempt, int] = {}
        horizon: datetime | None = None
        for event in events:
            horizon = event.time if horizon is None else max(horizon, event.time)
            key = (event.job_key, event.attempt or 1)
            if isinstance(event, JobPlaced) and key not in placed_at:
                placed_at[key] = event.time
                gpus[key] = sum(len(a.gpus) for a in event.data.assignments)
            elif isinstance(event, JobStateChanged) and event.data.to_state is JobState.FAILED:
                failed_at.setdefault(key, event.time)
        return cls(failed_at, placed_at, gpus, horizon)


def recorded_side(events: Iterable[Event]) -> Side:
    """The recorded log's recovery actions, at their recorded times."""
    from_recovery = [e for e in events if e.source == RECOVERY]
    return Side(
        decisions=[(e, e.time) for e in from_recovery if isinstance(e, RecoveryDecided)],
        requests=[(e, e.time) for e in from_recovery if isinstance(e, RetryRequested | ResumeRequested)],
        abandons=[(e, e.time) for e in from_recovery if isinstance(e, CancelRequested)],
    )


@dataclass(frozen=True)
class _Outcome:
    """One decided failure on one side."""

    recovered_at: datetime | None
    waited_s: float
    gpu_hours: float
    borrowed_delay: bool
    still_waiting: bool


def _first_per_attempt(pairs: Iterable[tuple[Event, datetime]]) -> dict[Attempt, datetime]:
    first: dict[Attempt, datetime] = {}
    for event, when in pairs:
        key = (event.job_key, event.attempt or 1)
        first[key] = min(first.get(key, when), when)
    return first


def _abandons(side: Side) -> dict[str, datetime]:
    first: dict[str, datetime] = {}
    for event, when in side.abandons:
        first[event.job_key] = min(first.get(event.job_key, when), when)
    return first


def _scheduling_delays(facts: LogFacts, recorded: Side) -> dict[Attempt, float]:
    """Per failed attempt the recorded log retried: seconds from the retry request to the next placement."""
    delays = {}
    for (job_id, number), requested in _first_per_attempt(recorded.requests).items():
        placed = facts.placed_at.get((job_id, number + 1))
        if placed is not None:
            delays[job_id, number] = max((placed - requested).total_seconds(), 0.0)
    return delays


def _outcomes(facts: LogFacts, side: Side, delays: dict[Attempt, float], *, replayed: bool) -> dict[Attempt, _Outcome]:
    """Each decided failure's recovery on this side: when it ran again, how long it waited, at what GPU cost."""
    requested = _first_per_attempt(side.requests)
    abandoned = _abandons(side)
    fallback = statistics.median(delays.values()) if delays else None
    outcomes: dict[Attempt, _Outcome] = {}
    for decided, _when in side.decisions:
        key = (decided.job_key, decided.attempt or 1)
        failed = facts.failed_at.get(key)
        if key in outcomes or failed is None or facts.horizon is None:
            continue  # a later decision about the same attempt (an owner's), or no recorded failure to measure from
        job_id, number = key
        recovered: datetime | None = None
        borrowed = False
        if not replayed:
            recovered = facts.placed_at.get((job_id, number + 1)) if key in requested else None
        elif key in requested:
            delay = delays.get(key)
            if delay is None and fallback is not None:
                delay, borrowed = fallback, True
            if delay is not None:
                recovered = requested[key] + timedelta(seconds=delay)
        if recovered is not None and recovered > facts.horizon:
            recovered = None  # after the recorded past ends: not something the log can compare
        end = recovered or abandoned.get(job_id) or facts.horizon
        end = max(end, failed)
        waited = (end - failed).total_seconds()
        gpus = facts.gpus.get(key, 0)
        still = recovered is None and job_id not in abandoned
        outcomes[key] = _Outcome(recovered, waited, gpus * waited / _SECONDS_PER_HOUR, borrowed, still)
    return outcomes


def _recovery_times(facts: LogFacts, outcomes: dict[Attempt, _Outcome]) -> dict[str, Any]:
    times = sorted(
        (o.recovered_at - facts.failed_at[key]).total_seconds()
        for key, o in outcomes.items()
        if o.recovered_at is not None
    )
    return {
        "recovered": len(times),
        "not_recovered": sum(o.recovered_at is None for o in outcomes.values()),
        "still_waiting_at_log_end": sum(o.still_waiting for o in outcomes.values()),
        "p50_s": round(statistics.median(times), 3) if times else None,
        "max_s": round(times[-1], 3) if times else None,
        "total_s": round(sum(times), 3),
        "placement_delay_borrowed": sum(o.borrowed_delay for o in outcomes.values()),
    }


def gate_refusals(decisions: Iterable[tuple[RecoveryDecided, datetime]]) -> tuple[int, Counter[str]]:
    """Training decisions whose gate refused a checkpoint newer than the one resumed from, and the refused fields."""
    count = 0
    fields: Counter[str] = Counter()
    for decided, _when in decisions:
        data = decided.data
        if data.workload_class != WorkloadClass.TRAINING.value or not data.refused:
            continue
        resumed = data.checkpoint.step if data.checkpoint is not None else None
        newer = [r for r in data.refused if resumed is None or r.checkpoint.step > resumed]
        if newer and data.action in {RecoveryAction.RESUME, RecoveryAction.MANUAL}:
            count += 1
            fields.update({r.field for r in newer})
    return count, fields


def outcome_deltas(events: Sequence[Event], recorded: Side, new: Side) -> dict[str, Any]:
    """`gpu_hours_held_waiting`, `time_to_recover` and `resumes_refused_by_gate`, recorded and new."""
    facts = LogFacts.of(events)
    delays = _scheduling_delays(facts, recorded)
    recorded_at = {event.id: when for event, when in (*recorded.requests, *recorded.abandons)}
    new = Side(
        decisions=new.decisions,
        requests=[(e, recorded_at.get(e.id, when)) for e, when in new.requests],
        abandons=[(e, recorded_at.get(e.id, when)) for e, when in new.abandons],
    )
    old_outcomes = _outcomes(facts, recorded, delays, replayed=False)
    new_outcomes = _outcomes(facts, new, delays, replayed=True)
    old_hours = round(sum(o.gpu_hours for o in old_outcomes.values()), 6)
    new_hours = round(sum(o.gpu_hours for o in new_outcomes.values()), 6)
    old_refused, old_fields = gate_refusals(recorded.decisions)
    new_refused, new_fields = gate_refusals(new.decisions)
    return {
        "gpu_hours_held_waiting": {"recorded": old_hours, "new": new_hours, "delta": round(new_hours - old_hours, 6)},
        "time_to_recover": {
            "recorded": _recovery_times(facts, old_outcomes),
            "new": _recovery_times(facts, new_outcomes),
        },
        "resumes_refused_by_gate": {
            "recorded": old_refused,
            "new": new_refused,
            "delta": new_refused - old_refused,
            "fields": {"recorded": dict(sorted(old_fields.items())), "new": dict(sorted(new_fields.items()))},
        },
    }
