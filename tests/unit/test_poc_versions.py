"""The inference POC's version steps judged from rows alone: a replica drill's report read from request
provenance, and the upgrade, rollback and scale-down verdicts read from the replicas' timelines."""

from __future__ import annotations

from typing import Any

from lanes_cli.drills import drill_reports, replica_drill_report
from lanes_cli.poc_inference import inference_verdict, judge_inference, judge_versions
from lanes_cli.poc_plan import InferenceStep

Row = dict[str, Any]
V1 = ("a1", "b1")
V2 = ("a2", "b2")


def _at(second: float) -> str:
    return f"2026-12-07T10:00:{second:09.6f}Z"


def _row(job: str, at: float, event: str, attempt: int = 1, **data: Any) -> Row:
    return {
        "id": f"{job}-{event}-{at}",
        "time": _at(at),
        "type": f"io.lanes.job.{event}.v1",
        "job_id": job,
        "attempt": attempt,
        "data": data,
    }


def _replica(job: str, version: str, *, released_at: float | None = None) -> list[Row]:
    rows = [
        _row(job, 0, "submitted", spec={"serving": {"model": "tiny-chat", "version": version}}),
        _row(job, 1 if version == "v1" else 10, "replica_state", state="ready"),
    ]
    if released_at is not None:
        rows.append(_row(job, released_at, "state_changed", to_state="released"))
    return rows


def _drill(job: str, at: float, kind: str, duration_s: float | None = None) -> Row:
    return _row(job, at, "drill_injected", kind=kind, node="n1", rank=0, pid=42, duration_s=duration_s)


def _request(rid: str, at: float, took_s: float, version: str, *tries: tuple[str, str, int], status: str = "ok") -> Row:
    """A request received at `at` for `took_s`; each try (replica, outcome, first token) took an equal share."""
    attempts = [
        {"replica": replica, "outcome": outcome, "first_token": first, "elapsed_ms": took_s * 1000 / len(tries)}
        for replica, outcome, first in tries
    ]
    data = {
        "request_id": rid,
        "status": status,
        "version": version,
        "replica": tries[-1][0],
        "attempts": attempts,
        "continuations": sum(1 for _, outcome, _ in tries if outcome == "failed_mid_stream") if status == "ok" else 0,
        "received_at": _at(at),
        "latency_ms": took_s * 1000,
    }
    return {"id": f"req-{rid}", "time": _at(at + took_s), "type": "io.lanes.request.served.v1", "data": data}


def _story() -> tuple[dict[str, list[Row]], list[Row]]:
    """A story that went right: every drill's streams continued on or finished where they should."""
    replicas = {
        "a1": [
            *_replica("a1", "v1", released_at=60),
            _drill("a1", 40, "replica-pause", 6),
            _drill("a1", 50, "replica-drain"),
        ],
        "b1": _replica("b1", "v1", released_at=70),
        "a2": [*_replica("a2", "v2", released_at=35), _drill("a2", 20, "replica-kill")],
        "b2": [*_replica("b2", "v2", released_at=35), _drill("b2", 30, "replica-drain")],
    }
    replicas["a2"].append(_row("a2", 25, "replica_state", attempt=2, state="ready"))
    requests = [
        _request("before", 5, 1, "v1", ("a1", "ok", 0)),
        _request("split-v1", 15, 1, "v1", ("b1", "ok", 0)),
        _request("killed", 19.5, 1, "v2", ("a2", "failed_mid_stream", 0), ("b2", "ok", 12)),
        _request("drained", 29.5, 1, "v2", ("b2", "ok", 0)),
        _request("after-rollback", 31, 1, "v1", ("b1", "ok", 0)),
        _request("paused", 39, 4, "v1", ("a1", "failed_mid_stream", 0), ("b1", "ok", 3)),
        _request("scaled", 49.5, 1, "v1", ("a1", "ok", 0)),
        _request("after-scale-down", 51, 1, "v1", ("b1", "ok", 0)),
    ]
    return replicas, requests


def test_a_replica_drill_is_judged_by_the_streams_it_had_in_flight() -> None:
    replicas, requests = _story()
    kill = replica_drill_report(replicas["a2"][-2], requests)
    assert (kill.in_flight, kill.continued, kill.moved_at, kill.took_over) == (("killed",), ("killed",), (12,), ("b2",))
    assert kill.first_move_s == 0.0  # its first try ended half a second in, as the drill began
    assert not kill.lost
    drain = replica_drill_report(replicas["b2"][-1], requests)
    assert (drain.in_flight, drain.finished_in_place, drain.routed_after) == (("drained",), ("drained",), 0)
    # A drill on a replica is not a rank's: `lanes poc` and the rungs leave it out of their drill reports.
    assert drill_reports(replicas["a2"]) == []


def test_the_upgrade_rollback_and_scale_down_pass_on_a_story_that_lost_nothing() -> None:
    replicas, requests = _story()
    judged = judge_versions(("v1", "v2"), replicas, requests)
    assert {step: verdict["verdict"] for step, verdict in judged.items()} == {
        InferenceStep.UPGRADE: "passed",
        InferenceStep.ROLLBACK: "passed",
        InferenceStep.SCALE_DOWN: "passed",
    }, judged
    assert judged[InferenceStep.UPGRADE]["clients"] == {"continued": 1}
    assert judged[InferenceStep.ROLLBACK]["served_after"] == {"v1": 4}  # every request after the last drain
    assert judged[InferenceStep.SCALE_DOWN]["replicas_left"] == ["b1"]
    steps = judge_inference((InferenceStep.UPGRADE, InferenceStep.SCALE_DOWN), {}, requests, "x", judged)
    assert inference_verdict(steps)["verdict"] == "passed"


def test_each_missing_link_of_a_version_step_is_named() -> None:
    replicas, requests = _story()
    replicas["a2"] = [r for r in replicas["a2"] if r.get("attempt") == 1]  # never replaced
    replicas["b2"] = [*replicas["b2"][:-2], replicas["b2"][-1]]  # drained, never released
    replicas["a1"] = [r for r in replicas["a1"] if (r.get("data") or {}).get("kind") != "replica-pause"]
    requests[2] = _request("killed", 19.5, 1, "v2", ("a2", "failed_mid_stream", 0), status="failed")
    requests.append(_request("late-v2", 32, 1, "v2", ("b2", "ok", 0)))
    judged = judge_versions(("v1", "v2"), replicas, requests, ("a note",))
    upgrade, rollback, scale_down = (
        judged[s] for s in (InferenceStep.UPGRADE, InferenceStep.ROLLBACK, InferenceStep.SCALE_DOWN)
    )
    assert upgrade["verdict"] == "pending evidence"
    assert "replica-kill of replica a2 on n1: 1 streams errored (killed)" in upgrade["missing"]
    assert "the killed replica a2 was not replaced in rotation" in upgrade["missing"]
    assert rollback["verdict"] == "pending evidence"
    assert "b2 of v2 was not released" in rollback["missing"]
    assert "1 requests received after the rollback were served by v2" in rollback["missing"]
    assert scale_down["missing"] == "no replica-pause drill on a v1 replica"
    assert upgrade["notes"] == ["a note"]
    nothing = judge_versions(("v1", "v2"), {}, [])
    assert "no replica of v2 was started" in nothing[InferenceStep.UPGRADE]["missing"]
    assert "no replica-drain drill on a v2 replica" in nothing[InferenceStep.ROLLBACK]["missing"]
