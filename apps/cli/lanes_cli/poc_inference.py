"""The inference steps of `lanes poc run`, judged from the replicas' timelines and the requests' provenance.

Pure functions of timeline rows (`lanes.job.<replica>.>`) and request rows (`lanes.req.>`). The runner drives
the toy model's story (`lanes_cli.scenarios.inference`: two replicas behind the router under load, then one
replica's node fails) and the version steps (`lanes_cli.poc_serve`: an upgrade, a rollback, a scale-down,
each with replica drills); a step the run did not take is pending evidence, saying so: a step is never
passed for want of a test.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from typing import Any

from lanes_cli.drills import ReplicaDrillReport, replica_drill_report
from lanes_cli.poc import Row, Verdict
from lanes_cli.poc_plan import InferenceStep
from lanes_cli.timeline import row_kind
from lanes_contract.events import DrillKind

NOT_DRIVEN = {
    InferenceStep.UPGRADE: "an upgrade to v2 (weighted)",
    InferenceStep.ROLLBACK: "a rollback to v1",
    InferenceStep.SCALE_DOWN: "a scale-down by one replica with streams in flight",
}


def client_saw(request: Row) -> str:
    """What the client of one request saw, from its provenance.

    failed_over_unseen (moved before its first token), continued (moved mid-stream, the client saw one stream),
    errored_mid_stream, told_to_retry (429/503), refused, or ok (one replica, one try).
    """
    data = request.get("data") or {}
    attempts = data.get("attempts") or []
    status = data.get("status")
    if status == "ok":
        if data.get("continuations"):
            return "continued"
        return "failed_over_unseen" if len(attempts) > 1 else "ok"
    if any(a.get("outcome") == "failed_mid_stream" for a in attempts):
        return "errored_mid_stream"
    if data.get("http_status") in {429, 503}:
        return "told_to_retry"
    return "refused" if status == "rejected" else "errored"


def _step(step: InferenceStep, verdict: Verdict, missing: str = "", **figures: Any) -> dict[str, Any]:
    return {"step": step.value, "verdict": verdict.value, "missing": missing} | figures


def _states(rows: list[Row], attempt: int) -> set[str]:
    return {
        str((r.get("data") or {}).get("to_state"))
        for r in rows
        if row_kind(r) == "state_changed" and r.get("attempt") == attempt
    }


def _ready(rows: list[Row], attempt: int) -> bool:
    return any(
        row_kind(r) == "replica_state" and r.get("attempt") == attempt and (r.get("data") or {}).get("state") == "ready"
        for r in rows
    )


def judge_inference(
    steps: tuple[InferenceStep, ...],
    replicas: dict[str, list[Row]],
    requests: list[Row],
    failed: str,
    driven: dict[InferenceStep, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Each plan step's verdict: `replicas` maps each replica job to its rows; `failed` is the one whose node failed.

    `driven`: the version steps' verdicts (`judge_versions`), for the steps the run took.
    """
    mine = [r for r in requests if (r.get("data") or {}).get("replica") in replicas]
    seen = Counter(client_saw(r) for r in mine)
    judged = []
    for step in steps:
        if driven and step in driven:
            judged.append(driven[step])
        elif step in NOT_DRIVEN:
            missing = f"lanes poc run does not drive {NOT_DRIVEN[step]} yet: no request provenance for it on the log"
            judged.append(_step(step, Verdict.PENDING_EVIDENCE, missing))
        elif step is InferenceStep.START:
            idle = [job for job, rows in replicas.items() if "running" not in _states(rows, 1)]
            missing = f"replica {', '.join(idle)} never ran" if idle else ""
            judged.append(_step(step, Verdict.PENDING_EVIDENCE if idle else Verdict.PASSED, missing))
        elif step is InferenceStep.HEALTH:
            unhealthy = [job for job, rows in replicas.items() if not _ready(rows, 1)]
            missing = f"replica {', '.join(unhealthy)} never passed the router's health check" if unhealthy else ""
            judged.append(_step(step, Verdict.PENDING_EVIDENCE if unhealthy else Verdict.PASSED, missing))
        elif step is InferenceStep.TRAFFIC:
            served = [r for r in mine if (r.get("data") or {}).get("status") == "ok"]
            bare = [
                r for r in served if not ((r.get("data") or {}).get("version") and (r.get("data") or {}).get("gpus"))
            ]
            missing = ""
            if not served:
                missing = "no request was served"
            elif bare:
                missing = f"request {bare[0].get('id')} names no version or GPUs"
            verdict = Verdict.PENDING_EVIDENCE if missing else Verdict.PASSED
            judged.append(_step(step, verdict, missing, requests=len(mine), clients=dict(seen)))
        else:
            judged.append(_node_fault(replicas.get(failed, []), failed, seen))
    return judged


def _node_fault(rows: list[Row], failed: str, seen: Counter[str]) -> dict[str, Any]:
    settled = [r for r in rows if row_kind(r) == "finding" and (r.get("data") or {}).get("settled")]
    decided = [r for r in rows if row_kind(r) == "recovery_decided"]
    missing = []
    if not settled:
        missing.append(f"no settled finding for replica {failed}")
    if not decided:
        missing.append(f"no recovery decision for replica {failed}")
    if not _ready(rows, 2):
        missing.append(f"no replacement of replica {failed} back in rotation")
    if seen.get("errored_mid_stream") or seen.get("errored"):
        missing.append(f"{seen['errored_mid_stream'] + seen['errored']} requests errored")
    first = ((settled[-1].get("data") or {}).get("first_error") or {}) if settled else {}
    return _step(
        InferenceStep.NODE_FAULT,
        Verdict.PENDING_EVIDENCE if missing else Verdict.PASSED,
        "; ".join(missing),
        replica=failed,
        named=f"{first.get('lane')}/{first.get('category')} on {first.get('node')}" if first else None,
        clients=dict(seen),
    )


def inference_verdict(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The inference column of the table: passed only when every step of the plan passed."""
    pending = [s for s in steps if s["verdict"] != Verdict.PASSED.value]
    if not steps:
        return {"capability": "inference protection", "rung": "inference", "verdict": "not applicable", "missing": ""}
    missing = "; ".join(f"{s['step']}: {s['missing']}" for s in pending)
    verdict = Verdict.PENDING_EVIDENCE if pending else Verdict.PASSED
    return {"capability": "inference protection", "rung": "inference", "verdict": verdict.value, "missing": missing}


def _version_of(rows: list[Row]) -> str | None:
    submitted = next((r for r in rows if row_kind(r) == "submitted"), None)
    serving = (((submitted or {}).get("data") or {}).get("spec") or {}).get("serving") or {}
    return serving.get("version")


def _released(rows: list[Row]) -> bool:
    states = [r for r in rows if row_kind(r) == "state_changed"]
    return bool(states) and (states[-1].get("data") or {}).get("to_state") == "released"


def _replaced(rows: list[Row]) -> bool:
    """A later attempt of the replica passed the router's health check."""
    return any(
        row_kind(r) == "replica_state"
        and int(r.get("attempt") or 0) >= 2  # noqa: PLR2004 - the attempt after the first
        and (r.get("data") or {}).get("state") == "ready"
        for r in rows
    )


def _tried(request: Row) -> set[str]:
    return {str(a.get("replica")) for a in (request.get("data") or {}).get("attempts") or []}


def _when(row: Row) -> datetime:
    return datetime.fromisoformat(str(row["time"]))


def _received(request: Row) -> datetime:
    return datetime.fromisoformat(str((request.get("data") or {}).get("received_at")))


def _drills(replicas: dict[str, list[Row]], jobs: list[str], kind: DrillKind) -> list[Row]:
    return sorted(
        (
            r
            for job in jobs
            for r in replicas.get(job, [])
            if row_kind(r) == "drill_injected" and (r.get("data") or {}).get("kind") == kind.value
        ),
        key=_when,
    )


def _drill_misses(report: ReplicaDrillReport, same_version: set[str]) -> list[str]:
    misses = []
    if not report.in_flight:
        misses.append(f"{report.where}: no stream was in flight")
    if report.errored:
        misses.append(f"{report.where}: {len(report.errored)} streams errored ({', '.join(report.errored[:3])})")
    if strays := sorted(set(report.took_over) - same_version):
        misses.append(f"{report.where}: streams continued on {', '.join(strays)}, of another version")
    if report.routed_after:
        misses.append(f"{report.where}: {report.routed_after} new requests still went to it")
    return misses


def _judged(
    step: InferenceStep, missing: list[str], drills: list[ReplicaDrillReport], clients: dict[str, int], **figures: Any
) -> dict[str, Any]:
    """A version step's verdict: passed with nothing missing, its drills' reports and what their clients saw."""
    verdict = Verdict.PENDING_EVIDENCE if missing else Verdict.PASSED
    drilled = [rep.as_json() for rep in drills]
    return _step(step, verdict, "; ".join(missing), **figures, drills=drilled, clients=clients)


def judge_versions(
    versions: tuple[str, str], replicas: dict[str, list[Row]], requests: list[Row], notes: tuple[str, ...] = ()
) -> dict[InferenceStep, dict[str, Any]]:
    """The upgrade, rollback and scale-down verdicts, from the version story's replicas and the requests.

    `replicas` maps each replica job of the story (both versions) to its rows; the drills on them say which
    step each belongs to: a replica-kill of a new-version replica (upgrade), replica-drains of the new version
    (rollback), a replica-pause and a replica-drain of an old-version replica (scale-down).
    """
    old, new = versions
    by_version: dict[str, list[str]] = {}
    for job, rows in replicas.items():
        by_version.setdefault(str(_version_of(rows)), []).append(job)
    olds, news = by_version.get(old, []), by_version.get(new, [])
    ours = [
        r for r in requests if {a.get("replica") for a in (r.get("data") or {}).get("attempts") or []} & set(replicas)
    ]

    def report(row: Row) -> ReplicaDrillReport:
        return replica_drill_report(row, ours)

    def saw(reports: list[ReplicaDrillReport]) -> dict[str, int]:
        flying = {rid for rep in reports for rid in rep.in_flight}
        return dict(Counter(client_saw(r) for r in ours if (r.get("data") or {}).get("request_id") in flying))

    def served(after: datetime | None) -> dict[str, int]:
        return dict(
            Counter(
                str((r.get("data") or {}).get("version"))
                for r in ours
                if (r.get("data") or {}).get("status") == "ok" and (after is None or _received(r) > after)
            )
        )

    judged: dict[InferenceStep, dict[str, Any]] = {}
    # Upgrade: the new version ready beside the old, traffic split by weight, a killed new replica's streams
    # continued on the other, and the killed one replaced.
    missing = [f"{job} of {new} never passed the router's health check" for job in news if not _ready(replicas[job], 1)]
    if not news:
        missing.append(f"no replica of {new} was started")
    kills = [report(r) for r in _drills(replicas, news, DrillKind.REPLICA_KILL)]
    if not kills:
        missing.append(f"no replica-kill drill on a {new} replica")
    for rep in kills:
        missing += _drill_misses(rep, set(news))
        if not _replaced(replicas[rep.replica]):
            missing.append(f"the killed replica {rep.replica} was not replaced in rotation")
    ready_rows = [r for job in news for r in replicas[job] if row_kind(r) == "replica_state"]
    since = min((_when(r) for r in ready_rows), default=None)
    split = served(since)
    if since is not None and not (split.get(new) and split.get(old)):
        missing.append(f"the weighted split served {split.get(old, 0)} on {old} and {split.get(new, 0)} on {new}")
    judged[InferenceStep.UPGRADE] = _judged(InferenceStep.UPGRADE, missing, kills, saw(kills), served=split)
    # Rollback: every new replica drained with streams in flight, none lost, none sent new work, then released;
    # after the last drain only the old version serves.
    drains = [report(r) for r in _drills(replicas, news, DrillKind.REPLICA_DRAIN)]
    missing = [] if drains else [f"no replica-drain drill on a {new} replica"]
    for rep in drains:
        missing += _drill_misses(rep, set(news))
    missing += [f"{job} of {new} was not released" for job in news if not _released(replicas[job])]
    last = max((_when(r) for r in _drills(replicas, news, DrillKind.REPLICA_DRAIN)), default=None)
    after = served(last) if last is not None else {}
    if after.get(new):
        missing.append(f"{after[new]} requests received after the rollback were served by {new}")
    judged[InferenceStep.ROLLBACK] = _judged(InferenceStep.ROLLBACK, missing, drains, saw(drains), served_after=after)
    # Scale-down: one old replica hangs after its first tokens (its streams move), then is drained with
    # streams in flight and released; the others serve on.
    pauses = [report(r) for r in _drills(replicas, olds, DrillKind.REPLICA_PAUSE)]
    leaving = [report(r) for r in _drills(replicas, olds, DrillKind.REPLICA_DRAIN)]
    missing = [] if pauses else [f"no replica-pause drill on a {old} replica"]
    missing += [] if leaving else [f"no replica-drain drill on a {old} replica"]
    for rep in pauses + leaving:
        missing += _drill_misses(rep, set(olds))
    missing += [
        f"the scaled-down replica {rep.replica} was not released"
        for rep in leaving
        if not _released(replicas[rep.replica])
    ]
    left = sorted(set(olds) - {rep.replica for rep in leaving})
    drilled = pauses + leaving
    judged[InferenceStep.SCALE_DOWN] = _judged(
        InferenceStep.SCALE_DOWN, missing, drilled, saw(drilled), replicas_left=left
    )
    if notes:
        for step in judged.values():
            step["notes"] = list(notes)
    return judged
