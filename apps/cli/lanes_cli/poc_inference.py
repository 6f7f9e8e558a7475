"""The inference steps of `lanes poc run`, judged from the replicas' timelines and the requests' provenance.

Pure functions of timeline rows (`lanes.job.<replica>.>`) and request rows (`lanes.req.>`). The runner drives
the toy model's story (`lanes_cli.scenarios.inference`: two replicas behind the router under load, then one
replica's node fails); the steps that story does not take (an upgrade, a rollback, a scale-down with
streams in flight) are pending evidence, each saying so: a step is never passed for want of a test.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from lanes_cli.poc import Row, Verdict
from lanes_cli.poc_plan import InferenceStep
from lanes_cli.timeline import row_kind

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
    steps: tuple[InferenceStep, ...], replicas: dict[str, list[Row]], requests: list[Row], failed: str
) -> list[dict[str, Any]]:
    """Each plan step's verdict: `replicas` maps each replica job to its rows; `failed` is the one whose node failed."""
    mine = [r for r in requests if (r.get("data") or {}).get("replica") in replicas]
    seen = Counter(client_saw(r) for r in mine)
    judged = []
    for step in steps:
        if step in NOT_DRIVEN:
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
