"""The incident bundle from timeline rows: first error, evidence per lane, timings, files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lanes_cli.incident import bundle, write_bundle


def _row(seq: int, kind: str, lane: str = "platform", second: int | None = None, **fields: Any) -> dict[str, Any]:
    return {
        "seq": seq,
        "id": f"event-{seq}",
        "time": f"2026-12-02T10:00:{second if second is not None else seq:02d}.000000Z",
        "type": f"io.lanes.job.{kind}.v1",
        "lane": lane,
        "job_id": "j1",
        "attempt": 1,
        "node": fields.pop("node", None),
        "rank": fields.pop("rank", None),
        "source": "tests",
        "data": fields.pop("data", {}),
    }


JOB: dict[str, Any] = {
    "job_id": "j1",
    "state": "released",
    "timeline": [
        _row(1, "submitted", second=0),
        _row(2, "rank_started", "host", second=2, node="n1", rank=0, data={"pid": 10}),
        _row(3, "rank_exited", "host", second=10, node="n1", rank=0, data={"exit_code": None, "signal": 9}),
        _row(
            4,
            "finding",
            "host",
            second=12,
            node="n1",
            data={
                "version": 1,
                "first_error": {"rank": 0, "node": "n1", "lane": "host", "category": "oom_kill", "summary": "OOM"},
                "missing_evidence": [{"lane": "network", "what": "link counters", "node": "n2", "rank": None}],
                "owner": "host team",
            },
        ),
        _row(5, "recovery_decided", second=13, data={"action": "retry"}),
        _row(6, "state_changed", second=20, data={"to_state": "running", "reason": "attempt 2 running"}),
    ],
}


def test_the_bundle_names_the_first_error_its_lane_owner_and_the_timings() -> None:
    summary = bundle(JOB)
    assert summary["summary"]["first_error"]["category"] == "oom_kill"
    assert summary["summary"]["lane"] == "host"
    assert summary["summary"]["owner"] == "host team"
    assert summary["missing_evidence"] == {"network": ["link counters (node n2)"]}
    assert summary["evidence"]["host"] == ["event-2", "event-3", "event-4"]
    assert summary["recovery"][0]["id"] == "event-5"
    assert summary["durations_s"] == {"to_detect": 10.0, "to_localize": 2.0, "to_decide": 3.0, "to_recover": 10.0}


def test_a_job_without_failure_has_no_first_error_and_no_timings() -> None:
    quiet = {
        "job_id": "j2",
        "timeline": [_row(1, "submitted"), _row(2, "state_changed", data={"to_state": "released"})],
    }
    summary = bundle(quiet)
    assert summary["summary"]["failed"] is False
    assert summary["summary"]["first_error"] is None
    assert summary["durations_s"]["to_detect"] is None


def test_the_bundle_is_written_as_json_html_and_replayable_ndjson(tmp_path: Path) -> None:
    lines = [json.dumps({"sequence": str(row["seq"]), "type": row["type"]}).encode() for row in JOB["timeline"]]
    paths = write_bundle(JOB, lines, tmp_path / "bundle")
    assert [p.name for p in paths] == ["incident.json", "timeline.html", "events.ndjson"]
    assert json.loads(paths[0].read_text())["job_id"] == "j1"
    assert "lanes-data" in paths[1].read_text()
    assert len(paths[2].read_text().splitlines()) == len(JOB["timeline"])


def _request(
    seq: int, request_id: str, served_by: str, *attempts: tuple[str, str, str], status: str = "ok"
) -> dict[str, Any]:
    return {
        "seq": seq,
        "id": f"req-event-{seq}",
        "time": f"2026-12-02T10:00:{seq:02d}.000000Z",
        "type": "io.lanes.req.served.v1",
        "data": {
            "request_id": request_id,
            "replica": served_by,
            "status": status,
            "http_status": 200 if status == "ok" else 502,
            "attempts": [{"replica": r, "node": n, "outcome": o} for r, n, o in attempts],
        },
    }


def test_a_replica_incident_lists_the_requests_it_touched_and_what_became_of_them() -> None:
    replica = {"job_id": "chat-a", "state": "failed", "timeline": [_row(1, "submitted", second=0)]}
    requests = [
        _request(2, "r-plain", "chat-a", ("chat-a", "n1", "ok")),
        _request(3, "r-moved", "chat-b", ("chat-a", "n1", "refused"), ("chat-b", "n2", "ok")),
        _request(4, "r-cut", "chat-a", ("chat-a", "n1", "failed_mid_stream"), status="failed"),
        _request(5, "r-elsewhere", "chat-b", ("chat-b", "n2", "ok")),
    ]
    touched = bundle(replica, requests)["requests"]
    assert touched["count"] == 3
    assert touched["outcomes"] == {"failed_mid_stream": 1, "failed_over": 1, "ok": 1}
    moved = next(r for r in touched["requests"] if r["request_id"] == "r-moved")
    assert moved["served_by"] == "chat-b"
    assert moved["attempts"] == ["chat-a:refused", "chat-b:ok"]
    assert "requests" not in bundle(replica)  # a job that serves nothing has no request section


def test_the_decision_chain_keeps_decisions_and_commands_in_order() -> None:
    rows = [
        _row(1, "submitted", second=0),
        _row(2, "state_changed", second=1, data={"to_state": "failed"}),
        _row(
            3,
            "recovery_decided",
            second=2,
            data={"action": "manual", "owner": "ml-oncall", "policy": "default", "policy_version": 1, "reason": "x"},
        ),
        _row(4, "hold_requested", second=3, data={"owner": "ml-oncall", "reason": "x"}),
        _row(5, "manual_action", second=4, data={"action": "approve", "requested_by": "alice", "reason": "fixed"}),
    ]
    chain = bundle({"job_id": "j1", "timeline": rows})["decision_chain"]
    assert [step["kind"] for step in chain] == ["recovery_decided", "hold_requested", "manual_action"]
    assert chain[0]["owner"] == "ml-oncall"
    assert chain[0]["policy_version"] == 1
    assert chain[2]["requested_by"] == "alice"
