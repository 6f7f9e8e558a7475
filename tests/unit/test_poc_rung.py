"""A POC rung judged from its timeline rows alone: stage times, the drill, completeness, goodput, the diff; and
the inference steps judged from the replicas' rows and the requests' provenance."""

from __future__ import annotations

from typing import Any

from lanes_cli.poc_inference import client_saw, inference_verdict, judge_inference
from lanes_cli.poc_plan import Criteria, Drill, InferenceStep, Rung
from lanes_cli.poc_rung import RungResult, diffs, judge, rung_passed
from lanes_contract.events import DrillKind

Row = dict[str, Any]
JOB = "poc-r2"


class _Timeline:
    """Rows of one job, each at a second offset from the submission, as `lanes timeline --json` prints them."""

    def __init__(self, job_id: str = JOB) -> None:
        self.job_id = job_id
        self.rows: list[Row] = []

    def add(self, at: float, kind: str, lane: str = "platform", **fields: Any) -> None:
        seq = len(self.rows) + 1
        seconds = f"{at:09.6f}"
        self.rows.append(
            {
                "seq": seq,
                "id": f"{self.job_id}-e{seq}",
                "time": f"2026-12-07T10:00:{seconds}Z",
                "type": f"io.lanes.job.{kind}.v1",
                "lane": lane,
                "job_id": self.job_id,
                "attempt": 1,
                "node": None,
                "rank": None,
                "source": "tests",
                "signature": "verified",
                "data": {},
            }
            | fields
        )

    def state(self, at: float, to_state: str, attempt: int = 1) -> None:
        self.add(at, "state_changed", attempt=attempt, data={"to_state": to_state, "reason": f"to {to_state}"})


def _attempt(t: _Timeline, attempt: int, start: float, nodes: list[str], steps: range) -> None:
    assignments = [{"rank": rank, "node": node, "gpus": [0, 1, 2, 3]} for rank, node in enumerate(nodes)]
    t.add(start, "placed", attempt=attempt, data={"assignments": assignments, "level": "leaf", "domain": "leaf-1"})
    for rank, node in enumerate(nodes):
        t.add(start + 0.1, "rank_started", "host", attempt=attempt, node=node, rank=rank, data={"pid": 100 + rank})
    for rank, node in enumerate(nodes):
        t.add(start + 2 + rank, "communicator_ready", "network", attempt=attempt, node=node, rank=rank)
    t.state(start + 2 + len(nodes), "running", attempt)
    # Each step takes 0.5 s on rank 0 and 0.25 s on the others: the step is its slowest rank's.
    for rank, node in enumerate(nodes):
        timings = [
            {"step": s, "compute_s": 0.4 if rank == 0 else 0.2, "wait_s": 0.1 if rank == 0 else 0.05} for s in steps
        ]
        t.add(
            start + 4,
            "heartbeat",
            "algorithm",
            attempt=attempt,
            node=node,
            rank=rank,
            data={"step": steps[-1], "timings": timings},
        )


def passing_rung(job_id: str = JOB, nodes: tuple[str, ...] = ("n1", "n2")) -> _Timeline:
    """Submitted at 0; a kill of rank 1 at 10 after the step-20 checkpoint, resumed from it, done at 30."""
    t = _Timeline(job_id)
    t.add(0, "submitted")
    t.state(0.01, "queued")
    _attempt(t, 1, 1.0, list(nodes), range(1, 25))
    t.add(
        8,
        "checkpoint_saved",
        "algorithm",
        node=nodes[0],
        rank=0,
        data={"step": 20, "path": "/c/20", "digest": "sha256:" + "a" * 64},
    )
    t.add(10, "drill_injected", data={"kind": "kill", "node": nodes[1], "rank": 1, "pid": 101})
    t.add(10.5, "rank_exited", "host", node=nodes[1], rank=1, data={"exit_code": None, "signal": 9})
    first = {"lane": "host", "category": "process_killed", "node": nodes[1], "rank": 1}
    silent = {"lane": "host", "category": "silent_node", "node": None, "rank": None}
    t.add(11, "finding", "host", data={"settled": False, "version": 1, "first_error": silent})  # names nobody yet
    t.add(12, "finding", "host", node=nodes[1], data={"settled": True, "version": 2, "first_error": first})
    t.state(12, "failed")
    t.add(12.5, "resources_released", data={"nodes": list(nodes), "gpus": 8})
    t.state(12.5, "released")
    decision = {
        "action": "resume",
        "owner": "host-team",
        "rollback": "lanes cancel",
        "expects": "io.lanes.job.attempt_requested.v1",
        "culprit": first,
        "finding_version": 1,
    }
    t.add(13, "recovery_decided", data=decision)
    t.add(13, "attempt_requested", attempt=2, data={"reason": "resume", "resume_step": 20})
    _attempt(t, 2, 14.0, list(nodes), range(21, 41))
    t.state(30, "succeeded", 2)
    t.add(30.5, "resources_released", attempt=2, data={"nodes": list(nodes), "gpus": 8})
    t.state(30.5, "released", 2)
    return t


def _result(t: _Timeline, nodes: int = 2, **kw: Any) -> RungResult:
    rung = Rung(nodes=nodes, gpus=4, drills=(Drill(kind=DrillKind.KILL, rank=1),))
    return RungResult(0, rung, t.job_id, t.rows, placed=kw.pop("placed", True), **kw)


def _verdicts(judged: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {cell["capability"]: cell for cell in judged["verdicts"]}


def test_a_rung_that_recovered_passes_with_its_stage_times_read_from_the_timeline() -> None:
    judged = judge(_result(passing_rung()), Criteria())
    assert judged["stages"] == {
        "placed_s": 1.0,
        "ranks_started_s": 1.1,
        "comm_init_s": 4.0,  # the last rank's communicator, not the first
        "first_step_s": 5.0,
        "checkpoint_s": 8.0,
        "completed_s": 30.0,
        "released_s": 30.5,
    }
    (drill,) = judged["drills"]
    assert drill | {"missing": ""} == drill
    assert (drill["kind"], drill["rank"], drill["named_rank"], drill["named_lane"]) == ("kill", 1, 1, "host")
    assert (drill["detect_s"], drill["localise_s"], drill["decide_s"]) == (0.5, 2.0, 3.0)
    assert drill["recover_s"] == 8.0  # attempt 2 running at 18 (placed at 14, its 2 ranks ready by 17)
    assert drill["released"]
    assert drill["resumed_from_verified"]
    assert drill["stopped"]
    assert drill["verdict"] == "passed"
    assert judged["completeness"] == {"algorithm": 1.0, "platform": 1.0, "host": 1.0, "network": 1.0}
    assert all(cell["verdict"] != "pending evidence" for cell in judged["verdicts"]), judged["verdicts"]
    assert _verdicts(judged)["inference protection"]["verdict"] == "not applicable"


def test_goodput_counts_a_redone_step_once_and_its_loss_in_gpu_seconds() -> None:
    figures = judge(_result(passing_rung()), Criteria())["goodput"]
    # Steps 1-24 ran in attempt 1, 21-40 in attempt 2: steps 21-24 were redone, 40 steps kept, 0.5 s each.
    assert figures["lost_steps"] == 4
    assert figures["lost_gpu_s"] == 4 * 0.5 * 8
    assert figures["ettr"] == round(40 * 0.5 / 30, 4)
    assert figures["interruptions"] == 1
    assert figures["badput_s"] == {
        "waiting": 2.0,  # submitted -> placed 1.0, attempt requested -> placed 1.0
        "startup": 6.0,  # placed -> last communicator ready, 3.0 each attempt
        "redone": 2.0,
        "slow_first_step": 0.0,
        "recovery_decision": 1.0,
    }


def test_a_finding_that_names_the_wrong_rank_leaves_the_drill_and_recovery_pending() -> None:
    t = passing_rung()
    for row in t.rows:
        if row["type"].endswith(".finding.v1"):
            row["data"]["first_error"] = row["data"]["first_error"] | {"rank": 0, "node": "n1"}
    judged = judge(_result(t), Criteria())
    (drill,) = judged["drills"]
    assert drill["verdict"] == "pending evidence"
    assert "rank 0 instead of 1" in drill["missing"]
    recovery = _verdicts(judged)["recovery"]
    assert recovery["verdict"] == "pending evidence"
    assert "rank 0 instead of 1" in recovery["missing"]


def test_a_job_that_never_completed_names_the_missing_stages_and_has_no_ettr() -> None:
    t = passing_rung()
    # Attempt 2 was requested and never placed: the job is still waiting when the rung runs out of time.
    t.rows = [row for row in t.rows if row["attempt"] == 1 or row["type"].endswith("attempt_requested.v1")]
    judged = judge(_result(t), Criteria())
    assert judged["stages"]["completed_s"] is None
    assert judged["goodput"]["ettr"] is None
    orchestration = _verdicts(judged)["orchestration"]
    assert orchestration["verdict"] == "pending evidence"
    assert "completed_s (state_changed to succeeded)" in orchestration["missing"]
    assert _verdicts(judged)["goodput"]["verdict"] == "pending evidence"


def test_a_settled_host_finding_without_its_node_is_named_incomplete() -> None:
    t = passing_rung()
    for row in t.rows:
        if row["type"].endswith(".finding.v1") and row["data"]["settled"]:
            row["node"] = None
    judged = judge(_result(t), Criteria())
    assert judged["completeness"]["host"] < 1
    assert _verdicts(judged)["responsibility"]["missing"].startswith("host lane: finding")


def test_a_lane_whose_events_lack_their_node_is_named_incomplete() -> None:
    t = passing_rung()
    for row in t.rows:
        if row["type"].endswith("communicator_ready.v1") and row["rank"] == 1:
            row["node"] = None
    judged = judge(_result(t), Criteria())
    assert judged["completeness"]["network"] == 0.5
    responsibility = _verdicts(judged)["responsibility"]
    assert responsibility["verdict"] == "pending evidence"
    assert responsibility["missing"].startswith("network lane: communicator_ready")
    assert "lacks node" in responsibility["missing"]


def test_an_unsigned_event_leaves_audit_pending() -> None:
    t = passing_rung()
    t.rows[3]["signature"] = "unsigned"
    audit = _verdicts(judge(_result(t), Criteria()))["audit"]
    assert audit["verdict"] == "pending evidence"
    assert "unsigned" in audit["missing"]


def test_a_rung_that_fails_after_one_that_passed_gets_the_diff_of_the_two() -> None:
    small = judge(_result(passing_rung("r1", ("n1", "n2"))), Criteria())
    wrong = passing_rung("r2", ("n1", "n2", "n3", "n4"))
    for row in wrong.rows:
        if row["type"].endswith(".finding.v1"):
            row["data"]["first_error"] = row["data"]["first_error"] | {"lane": "network"}
    big = judge(_result(wrong, nodes=4), Criteria())
    assert rung_passed(small)
    assert not rung_passed(big)
    registered = [
        {
            "type": "io.lanes.node.registered.v1",
            "node": node,
            "data": {"nvlink_domain": f"nvl-{node}", "leaf": leaf, "spine": "s1"},
        }
        for node, leaf in (("n1", "leaf-1"), ("n2", "leaf-1"), ("n3", "leaf-2"), ("n4", "leaf-2"))
    ]
    cordoned = {"type": "io.lanes.node.state_changed.v1", "node": "n2", "data": {"state": "cordoned"}}
    interfaces = {f"n{i}": f"veth{i}" for i in range(1, 5)}
    (diff,) = diffs([small, big], [*registered, cordoned], interfaces)
    assert diff["from"] == "2x4"
    assert diff["to"] == "4x4"
    assert diff["nodes_added"] == ["n3", "n4"]
    assert big["nodes_placed"] == ["n1", "n2", "n3", "n4"]
    assert diff["domains_crossed"] == {"nvlink_domain": ["nvl-n3", "nvl-n4"], "leaf": ["leaf-2"], "spine": []}
    assert diff["interfaces"] == {"n3": "veth3", "n4": "veth4"}
    assert diff["resource_states"] == {"n1": "ready", "n2": "cordoned", "n3": "ready", "n4": "ready"}
    assert {f["capability"] for f in diff["failed"]} >= {"recovery"}
    later = cordoned | {"node": "n1", "time": "2026-12-07T11:00:00Z"}  # after the rung ended: not its state
    (diff,) = diffs([small, big], [*registered, cordoned, later], interfaces)
    assert diff["resource_states"]["n1"] == "ready"
    assert diffs([big, small], registered, interfaces) == []  # a fix at scale is not a scale-only failure
    assert diffs([small, small], registered, interfaces) == []


def test_a_rung_never_placed_is_pending_with_the_schedulers_reason_and_no_stage() -> None:
    t = _Timeline("r9")
    t.add(0, "submitted")
    t.add(0.1, "waiting", data={"reason": "spec_mismatch", "detail": "needs 32 GPUs"})
    judged = judge(_result(t, nodes=8, placed=False, unplaced_reason="spec_mismatch: needs 32 GPUs"), Criteria())
    assert set(judged["stages"].values()) == {None}
    assert judged["drills"] == []
    cells = _verdicts(judged)
    assert cells["orchestration"]["verdict"] == "pending evidence"
    assert "never placed: spec_mismatch: needs 32 GPUs" in cells["orchestration"]["missing"]
    assert cells["recovery"]["verdict"] == "pending evidence"
    assert cells["topology"]["verdict"] == "not applicable"


def _request(replica: str, status: str = "ok", **data: Any) -> Row:
    attempts = data.pop("attempts", [{"replica": replica, "outcome": "ok", "elapsed_ms": 5.0}])
    fields = {"replica": replica, "status": status, "version": "v1", "gpus": [0], "attempts": attempts} | data
    return {"id": f"req-{replica}-{len(attempts)}-{status}", "type": "io.lanes.request.served.v1", "data": fields}


def test_what_a_client_saw_is_read_from_its_requests_provenance() -> None:
    moved = [
        {"replica": "a", "outcome": "error", "elapsed_ms": 1.0},
        {"replica": "b", "outcome": "ok", "elapsed_ms": 2.0},
    ]
    cut = [{"replica": "a", "outcome": "failed_mid_stream", "elapsed_ms": 1.0}]
    assert client_saw(_request("a")) == "ok"
    assert client_saw(_request("b", attempts=moved)) == "failed_over_unseen"
    assert client_saw(_request("b", attempts=moved, continuations=1)) == "continued"
    assert client_saw(_request("a", "failed", attempts=cut, http_status=200)) == "errored_mid_stream"
    assert client_saw(_request("a", "rejected", http_status=503)) == "told_to_retry"
    assert client_saw(_request("a", "rejected", http_status=403)) == "refused"


def test_inference_steps_the_runner_does_not_take_are_pending_and_never_passed() -> None:
    a, b = _Timeline("a"), _Timeline("b")
    for t in (a, b):
        t.state(1, "running")
        t.add(2, "replica_state", data={"state": "ready"})
    a.add(
        5,
        "finding",
        "host",
        node="n1",
        data={"settled": True, "first_error": {"lane": "host", "category": "gpu_xid", "node": "n1"}},
    )
    a.add(6, "recovery_decided", data={"action": "replace"})
    a.add(9, "replica_state", attempt=2, data={"state": "ready"})
    requests = [_request("a"), _request("b", continuations=1), _request("elsewhere", "failed")]
    steps = {s["step"]: s for s in judge_inference(tuple(InferenceStep), {"a": a.rows, "b": b.rows}, requests, "a")}
    assert [steps[s]["verdict"] for s in ("start", "health", "traffic", "node_fault")] == ["passed"] * 4
    assert steps["traffic"]["clients"] == {"ok": 1, "continued": 1}  # a request of another model is not counted
    assert steps["node_fault"]["named"] == "host/gpu_xid on n1"
    for step in ("upgrade", "rollback", "scale_down"):
        assert steps[step]["verdict"] == "pending evidence"
        assert "does not drive" in steps[step]["missing"]
    cell = inference_verdict(list(steps.values()))
    assert cell["verdict"] == "pending evidence"
    assert cell["missing"].startswith("upgrade: ")


def test_a_replica_never_replaced_and_a_stream_cut_leave_the_node_fault_pending() -> None:
    a, b = _Timeline("a"), _Timeline("b")
    for t in (a, b):
        t.state(1, "running")
        t.add(2, "replica_state", data={"state": "ready"})
    cut = [{"replica": "a", "outcome": "failed_mid_stream", "elapsed_ms": 1.0}]
    steps = judge_inference(
        (InferenceStep.NODE_FAULT,), {"a": a.rows, "b": b.rows}, [_request("a", "failed", attempts=cut)], "a"
    )
    (fault,) = steps
    assert fault["verdict"] == "pending evidence"
    assert "no settled finding for replica a" in fault["missing"]
    assert "no replacement of replica a back in rotation" in fault["missing"]
    assert "1 requests errored" in fault["missing"]
