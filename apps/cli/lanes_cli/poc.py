"""`lanes poc`: the platform scorecard, computed from the log, never typed by hand.

For each capability of the playbook Lanes grows from, the verdict is **passed**, **pending evidence**
(naming the exact missing link) or **not applicable** (the events show the workload never exercised it).
There is no total score. The input is the timeline rows of `lanes timeline --json` (any set of jobs or
a time window); the same rows always give the same verdicts. Reasons name events by id, not by stream
sequence, so a drill re-played into another server gets the same verdicts, word for word.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from lanes_cli.drills import drill_reports
from lanes_cli.timeline import is_failure, row_kind
from lanes_cli.verdicts import decision_verdicts

Row = dict[str, Any]
TERMINAL = {"succeeded", "failed", "cancelled"}
USER_COMMANDS = {"cancel_requested", "retry_requested", "hold_requested", "resume_requested", "manual_action"}


class Verdict(StrEnum):
    """The three outcomes of a capability."""

    PASSED = "passed"
    PENDING_EVIDENCE = "pending evidence"
    NOT_APPLICABLE = "not applicable"


@dataclass(frozen=True)
class CapabilityResult:
    """One capability's verdict and why."""

    capability: str
    verdict: Verdict
    reason: str

    def as_json(self) -> dict[str, str]:
        """The row of `lanes poc --json`."""
        return {"capability": self.capability, "verdict": self.verdict.value, "reason": self.reason}


def _by_job(rows: Iterable[Row]) -> dict[str, list[Row]]:
    jobs: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        if row.get("job_id"):
            jobs[str(row["job_id"])].append(row)
    return dict(jobs)


def _failed_jobs(jobs: dict[str, list[Row]]) -> list[str]:
    # Judged by the job's state, not by rank exits: ranks terminated by a cancel are not a failure.
    return [
        job_id
        for job_id, rows in sorted(jobs.items())
        if any(row_kind(row) == "state_changed" and is_failure(row) for row in rows)
    ]


def topology_awareness(jobs: dict[str, list[Row]]) -> CapabilityResult:
    """Placements that say which topology domain they chose, and waits that say why."""
    name = "topology awareness"
    placements = [row for rows in jobs.values() for row in rows if row_kind(row) == "placed"]
    if not placements:
        return CapabilityResult(name, Verdict.NOT_APPLICABLE, "no job was placed")
    for row in placements:
        data = row.get("data") or {}
        if not data.get("domain"):
            return CapabilityResult(
                name,
                Verdict.PENDING_EVIDENCE,
                f"placement {row['id']} of job {row['job_id']} names no topology domain",
            )
    return CapabilityResult(name, Verdict.PASSED, f"{len(placements)} placements name their topology domain")


def job_lifecycle(jobs: dict[str, list[Row]]) -> CapabilityResult:
    """Every job's transitions carry a cause, and every ended attempt had its resources released."""
    name = "job orchestration and lifecycle"
    if not jobs:
        return CapabilityResult(name, Verdict.NOT_APPLICABLE, "no job on the timeline")
    for job_id, rows in sorted(jobs.items()):
        changes = [row for row in rows if row_kind(row) == "state_changed"]
        if not changes:
            return CapabilityResult(name, Verdict.PENDING_EVIDENCE, f"job {job_id} has no state change on the timeline")
        for row in changes:
            if not (row.get("data") or {}).get("reason"):
                return CapabilityResult(
                    name, Verdict.PENDING_EVIDENCE, f"transition {row['id']} of {job_id} has no cause"
                )
        states = [(row.get("data") or {}).get("to_state") for row in changes]
        if any(state in TERMINAL for state in states) and "released" not in states:
            return CapabilityResult(
                name, Verdict.PENDING_EVIDENCE, f"job {job_id} ended but its resources were never released"
            )
    return CapabilityResult(name, Verdict.PASSED, f"{len(jobs)} jobs with caused transitions and released resources")


def communication_observability(jobs: dict[str, list[Row]]) -> CapabilityResult:
    """Every failed job has a finding that names its first error."""
    name = "communication observability"
    failed = _failed_jobs(jobs)
    if not failed:
        return CapabilityResult(name, Verdict.NOT_APPLICABLE, "no job failed, so there was no first error to find")
    for job_id in failed:
        findings = [
            row for row in jobs[job_id] if row_kind(row) == "finding" and (row.get("data") or {}).get("first_error")
        ]
        if not findings:
            return CapabilityResult(
                name, Verdict.PENDING_EVIDENCE, f"job {job_id} failed and no finding names its first error"
            )
    return CapabilityResult(name, Verdict.PASSED, f"first error found for {len(failed)} failed jobs")


def recovery(jobs: dict[str, list[Row]]) -> CapabilityResult:
    """Every failed job has a recovery decision that blamed what the final settled finding blames, followed through.

    A decision names the event that should follow it (a new attempt, a replacement replica...). A manual
    decision is complete when it names an owner and a deadline: what follows is a person's call. A decision
    whose culprit is not the attempt's final settled finding's fails the capability, by name, even when the
    mismatch was escalated.
    """
    name = "recovery"
    failed = _failed_jobs(jobs)
    if not failed:
        return CapabilityResult(name, Verdict.NOT_APPLICABLE, "no job failed, so nothing needed recovering")
    decided = 0
    for job_id in failed:
        rows = jobs[job_id]
        decisions = [(at, row) for at, row in enumerate(rows) if row_kind(row) == "recovery_decided"]
        if not decisions:
            return CapabilityResult(
                name, Verdict.PENDING_EVIDENCE, f"job {job_id} failed and no recovery decision is recorded"
            )
        for at, row in decisions:
            data = row.get("data") or {}
            if data.get("action") == "manual":
                if not (data.get("owner") and data.get("deadline")):
                    what = f"manual decision {row['id']} of {job_id} names no owner or no deadline"
                    return CapabilityResult(name, Verdict.PENDING_EVIDENCE, what)
            elif data.get("expects") and not any(later.get("type") == data["expects"] for later in rows[at + 1 :]):
                what = f"decision {row['id']} of {job_id} expected {data['expects']}, which never came"
                return CapabilityResult(name, Verdict.PENDING_EVIDENCE, what)
            decided += 1
        wrong = [v for v in decision_verdicts(rows) if not v.agrees]
        if wrong:
            return CapabilityResult(name, Verdict.PENDING_EVIDENCE, wrong[0].explain())
    return CapabilityResult(
        name,
        Verdict.PASSED,
        f"{decided} recovery decisions for {len(failed)} failed jobs, each followed through and blaming what the "
        "final settled finding blames",
    )


def inference_protection(jobs: dict[str, list[Row]], requests: list[Row]) -> CapabilityResult:
    """Inference jobs have per-request provenance (replica, version, attempts) on the log."""
    name = "inference protection"
    inference = [
        job_id
        for job_id, rows in jobs.items()
        if any(((row.get("data") or {}).get("spec") or {}).get("workload_class") == "inference" for row in rows)
    ]
    if not inference and not requests:
        return CapabilityResult(name, Verdict.NOT_APPLICABLE, "no inference job and no routed request")
    if not requests:
        return CapabilityResult(
            name, Verdict.PENDING_EVIDENCE, f"inference job {min(inference)} has no request provenance"
        )
    return CapabilityResult(name, Verdict.PASSED, f"{len(requests)} requests with provenance")


def joinability(rows: list[Row]) -> CapabilityResult:
    """Every event joins by job, attempt, node and time: the keys each team's evidence needs."""
    name = "cross-team joinability"
    if not rows:
        return CapabilityResult(name, Verdict.NOT_APPLICABLE, "no events")
    for row in rows:
        # A user's command names the job only; the lifecycle resolves it against the current attempt.
        keys = ("time", "job_id") if row_kind(row) in USER_COMMANDS else ("time", "job_id", "attempt")
        missing = [key for key in keys if row.get(key) in (None, "")]
        if row.get("lane") in {"host", "network"} and not row.get("node"):
            missing.append("node")
        if missing:
            what = f"{row.get('type')} {row.get('id')} ({row.get('lane')} lane)"
            return CapabilityResult(name, Verdict.PENDING_EVIDENCE, f"{what} lacks {', '.join(missing)}")
    return CapabilityResult(name, Verdict.PASSED, f"all {len(rows)} events carry job, attempt, node and time")


def fault_drills(rows: list[Row]) -> CapabilityResult:
    """Every drill's fault was localised: a settled finding named the injected rank, node and lane.

    A drill whose first error is named wrongly fails the capability, by name; one still playing out is
    pending. The times of each drill are in `lanes poc`'s per-drill lines.
    """
    name = "fault drills"
    reports = drill_reports(rows)
    if not reports:
        return CapabilityResult(name, Verdict.NOT_APPLICABLE, "no drill was injected")
    for report in reports:
        if report.wrong is not None:
            return CapabilityResult(name, Verdict.PENDING_EVIDENCE, f"drill {report.where}: {report.wrong}")
    return CapabilityResult(name, Verdict.PASSED, f"{len(reports)} drills, each localised to its rank, node and lane")


CAPABILITIES: tuple[Callable[[dict[str, list[Row]]], CapabilityResult], ...] = (
    topology_awareness,
    job_lifecycle,
    communication_observability,
    recovery,
)


def scorecard(rows: list[Row], requests: list[Row] | None = None) -> list[CapabilityResult]:
    """The verdict of every capability for these timeline rows (and router request rows, if any)."""
    jobs = _by_job(rows)
    return [
        *(capability(jobs) for capability in CAPABILITIES),
        inference_protection(jobs, requests or []),
        joinability(rows),
        fault_drills(rows),
    ]
