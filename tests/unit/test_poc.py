"""The scorecard: verdicts computed from timeline rows, deterministic, naming the missing link."""

from __future__ import annotations

import copy
from typing import Any

from lanes_cli.drills import complete, drill_reports
from lanes_cli.poc import Verdict, scorecard
from lanes_contract.events import DrillKind

Row = dict[str, Any]


def _row(seq: int, kind: str, lane: str = "platform", **fields: Any) -> Row:
    data = fields.pop("data", {})
    return {
        "seq": seq,
        "id": f"event-{seq}",
        "time": f"2026-12-02T10:00:{seq:02d}.000000Z",
        "type": f"io.lanes.job.{kind}.v1",
        "lane": lane,
        "job_id": "j1",
        "attempt": 1,
        "node": None,
        "rank": None,
        "source": "tests",
        "data": data,
    } | fields


def _change(seq: int, to_state: str, reason: str = "because") -> Row:
    return _row(seq, "state_changed", data={"to_state": to_state, "reason": reason})


def _culprit(node: str) -> dict[str, Any]:
    return {"rank": 0, "node": node, "lane": "host", "category": "oom_kill"}


def _finding(version: int, node: str, *, settled: bool = True) -> dict[str, Any]:
    return {"version": version, "first_error": _culprit(node), "settled": settled}


def _decided(action: str, node: str, version: int = 1) -> dict[str, Any]:
    return {"action": action, "culprit": _culprit(node), "finding_version": version}


def failing_drill() -> list[Row]:
    return [
        _row(1, "submitted", data={"spec": {"workload_class": "training"}}),
        _change(2, "queued"),
        _row(3, "placed", data={"assignments": [], "domain": "leaf-1", "level": "leaf"}),
        _change(4, "admitted"),
        _row(5, "rank_exited", lane="host", node="n1", rank=0, data={"exit_code": None, "signal": 9}),
        _row(6, "finding", lane="host", node="n1", data=_finding(1, "n1")),
        _change(7, "failed"),
        _row(8, "recovery_decided", data=_decided("resume", "n1") | {"expects": "io.lanes.job.attempt_requested.v1"}),
        _change(9, "released"),
        _row(10, "attempt_requested", data={"reason": "resume", "resume_step": 40}),
    ]


def verdicts(rows: list[Row], requests: list[Row] | None = None) -> dict[str, Verdict]:
    return {result.capability: result.verdict for result in scorecard(rows, requests)}


def test_a_complete_drill_passes_and_unexercised_capabilities_are_not_applicable() -> None:
    assert verdicts(failing_drill()) == {
        "topology awareness": Verdict.PASSED,
        "job orchestration and lifecycle": Verdict.PASSED,
        "communication observability": Verdict.PASSED,
        "recovery": Verdict.PASSED,
        "inference protection": Verdict.NOT_APPLICABLE,
        "cross-team joinability": Verdict.PASSED,
        "fault drills": Verdict.NOT_APPLICABLE,
    }


def test_the_same_rows_give_the_same_verdicts() -> None:
    rows = failing_drill()
    assert scorecard(rows) == scorecard(copy.deepcopy(rows))


def test_removing_the_host_teams_evidence_turns_observability_into_pending_naming_the_gap() -> None:
    rows = [row for row in failing_drill() if row["type"] != "io.lanes.job.finding.v1"]
    result = {r.capability: r for r in scorecard(rows)}["communication observability"]
    assert result.verdict is Verdict.PENDING_EVIDENCE
    assert "job j1 failed" in result.reason
    assert "first error" in result.reason


def test_a_decision_whose_expected_event_never_came_is_pending_and_a_manual_one_needs_owner_and_deadline() -> None:
    unfollowed = [row for row in failing_drill() if row["type"] != "io.lanes.job.attempt_requested.v1"]
    result = {r.capability: r for r in scorecard(unfollowed)}["recovery"]
    assert result.verdict is Verdict.PENDING_EVIDENCE
    assert "expected io.lanes.job.attempt_requested.v1" in result.reason
    manual = [*unfollowed[:7], _row(8, "recovery_decided", data=_decided("manual", "n1") | {"owner": "ml-oncall"})]
    assert "no deadline" in {r.capability: r for r in scorecard(manual)}["recovery"].reason
    manual[-1]["data"]["deadline"] = "2026-12-02T11:00:00Z"
    assert verdicts(manual)["recovery"] is Verdict.PASSED


def test_an_event_without_its_node_breaks_joinability_and_says_which() -> None:
    rows = failing_drill()
    rows[4] = rows[4] | {"node": None}
    result = {r.capability: r for r in scorecard(rows)}["cross-team joinability"]
    assert result.verdict is Verdict.PENDING_EVIDENCE
    assert "event-5" in result.reason
    assert "node" in result.reason


def test_a_successful_job_needs_no_recovery_or_first_error() -> None:
    rows = [
        _row(1, "submitted"),
        _change(2, "queued"),
        _row(3, "placed", data={"domain": "nvlink-0"}),
        _row(4, "rank_exited", lane="host", node="n1", rank=0, data={"exit_code": 0}),
        _change(5, "succeeded"),
        _change(6, "released"),
    ]
    result = verdicts(rows)
    assert result["communication observability"] is Verdict.NOT_APPLICABLE
    assert result["recovery"] is Verdict.NOT_APPLICABLE
    assert result["job orchestration and lifecycle"] is Verdict.PASSED


def test_missing_release_missing_domain_and_missing_provenance_are_named() -> None:
    rows = [
        _row(1, "submitted", data={"spec": {"workload_class": "inference"}}),
        _row(2, "placed", data={"assignments": []}),
        _change(3, "succeeded"),
    ]
    results = {r.capability: r for r in scorecard(rows)}
    assert results["topology awareness"].verdict is Verdict.PENDING_EVIDENCE
    assert "event-2" in results["topology awareness"].reason
    assert results["job orchestration and lifecycle"].verdict is Verdict.PENDING_EVIDENCE
    assert "never released" in results["job orchestration and lifecycle"].reason
    assert results["inference protection"].verdict is Verdict.PENDING_EVIDENCE
    assert verdicts(rows, [{"seq": 1}])["inference protection"] is Verdict.PASSED


def test_a_decision_on_another_culprit_than_the_final_settled_finding_fails_recovery_by_name() -> None:
    rows = failing_drill()
    rows.insert(8, _row(11, "finding", lane="host", node="n2", data=_finding(2, "n2")))
    result = {r.capability: r for r in scorecard(rows)}["recovery"]
    assert result.verdict is Verdict.PENDING_EVIDENCE
    assert result.reason == (
        "j1 attempt 1: decided on host/oom_kill on n1 rank 0 at v1; the settled finding v2 names host/oom_kill on n2 "
        "rank 0"
    )


def test_a_decision_on_an_unsettled_final_finding_fails_recovery() -> None:
    rows = failing_drill()
    rows[5] = rows[5] | {"data": _finding(1, "n1", settled=False)}
    result = {r.capability: r for r in scorecard(rows)}["recovery"]
    assert result.verdict is Verdict.PENDING_EVIDENCE
    assert "the unsettled finding v1" in result.reason


def test_a_superseded_and_replanned_decision_leaves_the_new_one_in_force() -> None:
    rows = failing_drill()
    rows[7] = rows[7] | {"data": _decided("resume", "n2") | {"expects": "io.lanes.job.attempt_requested.v1"}}
    superseded = {"decision_id": "event-8", "replanned": True}
    rows += [
        _row(11, "finding", lane="host", node="n1", data=_finding(2, "n1")),
        _row(12, "recovery_superseded", data=superseded),
        _row(
            13, "recovery_decided", data=_decided("resume", "n1", 2) | {"expects": "io.lanes.job.attempt_requested.v1"}
        ),
        _row(14, "attempt_requested", data={"reason": "resume"}),
    ]
    assert verdicts(rows)["recovery"] is Verdict.PASSED


def _injected(seq: int, kind: str, rank: int = 0, node: str = "n1") -> Row:
    return _row(
        seq, "drill_injected", node=node, rank=rank, data={"kind": kind, "node": node, "rank": rank, "pid": 4242}
    )


def test_a_drill_is_timed_from_its_injection_and_its_finding_judged_against_the_injected_rank() -> None:
    rows = [
        *failing_drill()[:4],
        _injected(4, "kill"),
        *failing_drill()[4:],
        _row(12, "state_changed", attempt=2, data={"to_state": "running", "reason": "resumed"}),
    ]
    (report,) = drill_reports(rows)
    assert (report.kind, report.rank, report.node, report.attempt) == (DrillKind.KILL, 0, "n1", 1)
    assert report.detect_s == 1.0  # the rank's exit, a second after the injection
    assert report.localise_s == 2.0  # the settled finding naming rank 0
    assert report.decide_s == 4.0
    assert report.recover_s == 8.0  # attempt 2 running
    assert report.decision == "resume"
    assert report.wrong is None
    assert complete(report)
    assert verdicts(rows)["fault drills"] is Verdict.PASSED


def test_a_drill_whose_finding_names_another_lane_or_rank_fails_the_capability_by_name() -> None:
    rows = [*failing_drill()[:4], _injected(4, "exception"), *failing_drill()[4:]]
    (report,) = drill_reports(rows)
    assert report.wrong == "the host lane instead of algorithm"
    result = {r.capability: r for r in scorecard(rows)}["fault drills"]
    assert result.verdict is Verdict.PENDING_EVIDENCE
    assert "exception of rank 0 on n1" in result.reason
    assert "the host lane instead of algorithm" in result.reason
    wrong_rank = [*failing_drill()[:4], _injected(4, "kill", rank=3), *failing_drill()[4:]]
    (other,) = drill_reports(wrong_rank)
    assert other.wrong == "rank 0 instead of 3"
    assert other.localise_s is None  # no finding named rank 3


def test_a_drill_still_playing_out_is_not_complete() -> None:
    (report,) = drill_reports([*failing_drill()[:4], _injected(4, "oom")])
    assert report.named is None
    assert report.wrong == "no settled finding yet"
    assert not complete(report)
    (slow,) = drill_reports([*failing_drill()[:4], _injected(4, "slow")])
    assert slow.wrong == "no slowdown reported yet"  # a straggler fails nothing: a slowdown must name it
    assert not complete(slow)


def test_a_slow_drill_is_named_by_the_attempts_slowdown_and_needs_no_decision() -> None:
    slowdown = {"kind": "compute_straggler", "rank": 0, "node": "n1", "onset_step": 40, "slowdown": 0.4}
    rows = [*failing_drill()[:4], _injected(4, "slow"), _row(9, "slowdown", lane="host", data=slowdown)]
    (slow,) = drill_reports(rows)
    assert slow.named == {"lane": "host", "category": "compute_straggler", "node": "n1", "rank": 0}
    assert (slow.detect_s, slow.localise_s, slow.decision) == (5.0, 5.0, None)
    assert slow.wrong is None
    assert complete(slow)
    elsewhere = {**slowdown, "rank": 3, "node": "n2"}
    (wrong,) = drill_reports(
        [*failing_drill()[:4], _injected(4, "slow"), _row(9, "slowdown", lane="network", data=elsewhere)]
    )
    assert wrong.wrong == "rank 3 instead of 0; node n2 instead of n1; the network lane instead of host"
