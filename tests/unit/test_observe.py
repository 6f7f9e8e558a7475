"""Observe mode without servers: `lanes run`'s identity and rank report, the Slurm mapping, the outbox.

The Slurm observations are folded through the lifecycle's own state machine, so "the right states and
attempts" is checked against the code that decides them in production.
"""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from lanes_cli.limits import MAX_RANKS
from lanes_contract.codec import decode_structured
from lanes_contract.events import (
    Event,
    Heartbeat,
    JobPlaced,
    JobSubmitted,
    JobWaiting,
    Lane,
    NodeStateChanged,
    RankExited,
    RetryRequested,
)
from lanes_contract.jobs import JobState
from lanes_contract.topology import NodeState
from lanes_lifecycle.domain.job import JobView, evolve
from lanes_observe import observed
from lanes_observe.outbox import Outbox
from lanes_observe.slurm import JobMemory, SlurmJob, SlurmNode, observe_job, observe_node, wait_mapping
from lanes_observe.wrap import RunReport, identity_from, launcher_kind, parse_ranks

NOW = datetime(2026, 12, 3, 7, 0, tzinfo=UTC)


def test_identity_comes_from_slurm_environment() -> None:
    env = {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1", "SLURMD_NODENAME": "gpu-7.cluster", "SLURM_PROCID": "3"}
    identity = identity_from(["python", "train.py"], env, max_ranks=MAX_RANKS)
    assert (identity.job_id, identity.attempt, identity.node, identity.ranks) == ("slurm-42", 2, "gpu-7", (3,))
    assert identity.source == "lanes-run/gpu-7"


def test_identity_of_torchrun_and_srun_and_flags() -> None:
    torchrun = ["torchrun", "--nnodes=2", "--nproc-per-node", "4", "--node-rank=1", "train.py"]
    assert launcher_kind(torchrun) == "torchrun"
    assert identity_from(torchrun, {}, job="j", max_ranks=MAX_RANKS).ranks == (4, 5, 6, 7)
    assert identity_from(["srun", "-n", "3", "a.out"], {}, job="j", max_ranks=MAX_RANKS).ranks == (0, 1, 2)
    flagged = identity_from(
        ["x"], {"RANK": "9"}, job="j", attempt=4, node="n-1", ranks="0-1,5", world_size=8, max_ranks=MAX_RANKS
    )
    assert (flagged.attempt, flagged.node, flagged.ranks, flagged.world_size) == (4, "n-1", (0, 1, 5), 8)
    with pytest.raises(ValueError, match="ranks"):
        parse_ranks("a-b", max_ranks=MAX_RANKS)


def test_srun_task_exits_name_the_failed_task_and_the_others_exited_zero() -> None:
    report = RunReport(identity_from(["srun", "-n", "3", "x"], {}, job="j", node="n1", max_ranks=MAX_RANKS))
    report.feed("stderr", "srun: error: n1: task 2: Exited with exit code 3")
    report.feed("stderr", "srun: error: n1: task 0: Killed")
    exits = [e for e in report.rank_exits(3) if isinstance(e, RankExited)]
    assert [(e.rank, e.data.exit_code, e.data.signal) for e in exits] == [(2, 3, None), (0, None, 9), (1, 0, None)]


def test_torchelastic_summary_names_the_failed_rank_first_and_the_gang_was_stopped() -> None:
    identity = identity_from(["torchrun", "--nproc-per-node=4", "t.py"], {}, job="j", node="n1", max_ranks=MAX_RANKS)
    report = RunReport(identity)
    summary = [
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
        "============================================================",
        "t.py FAILED",
        "------------------------------------------------------------",
        "Failures:",
        "  <NO_OTHER_FAILURES>",
        "------------------------------------------------------------",
        "Root Cause (first observed failure):",
        "[0]:",
        "  time      : 2026-12-03_07:00:01",
        "  host      : n1",
        "  rank      : 2 (local_rank: 2)",
        "  exitcode  : 1 (pid: 4242)",
        "  error_file: <N/A>",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
        "============================================================",
    ]
    evidence = [event for line in summary for event in report.feed("stderr", line)] + report.finish()
    assert all(event.jobid == "j" and event.attempt == 1 for event in evidence)
    exits = [e for e in report.rank_exits(1) if isinstance(e, RankExited)]
    assert [(e.rank, e.data.exit_code, e.data.signal) for e in exits] == [
        (2, 1, None),
        (0, None, 15),
        (1, None, 15),
        (3, None, 15),
    ]


def _watchdog_timeout(*, rank: int, seq: int) -> str:
    """A ProcessGroupNCCL watchdog line as torchrun prefixes it with the rank."""
    return (
        f"[rank{rank}]:[E1204 06:30:0{seq % 10}.123456 4242 ProcessGroupNCCL.cpp:616] [Rank {rank}] Watchdog caught "
        f"collective operation timeout: WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
        "Timeout(ms)=600000) ran for 600001 milliseconds before timing out."
    )


def test_each_exit_counts_the_evidence_its_rank_published_so_telemetry_waits_for_it() -> None:
    report = RunReport(
        identity_from(["torchrun", "--nproc-per-node=3", "t.py"], {}, job="j", node="n1", max_ranks=MAX_RANKS)
    )
    output = [
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "t.py", line 3, in <module>',
        "[rank1]: RuntimeError: CUDA error: an illegal memory access was encountered",
        *(_watchdog_timeout(rank=0, seq=seq) for seq in (7, 8)),
        "epoch 3 loss 0.25",
    ]
    published = [event for line in output for event in report.feed("stderr", line)] + report.finish()
    assert Counter(event.rank for event in published) == {0: 2, 1: 1}
    exits = [e for e in report.rank_exits(1) if isinstance(e, RankExited)]
    assert {e.rank: e.data.evidence for e in exits} == {0: 2, 1: 1, 2: 0}


def test_step_timings_become_each_ranks_heartbeats_a_second_at_most_and_the_rest_at_the_end() -> None:
    report = RunReport(
        identity_from(["torchrun", "--nproc-per-node=2", "t.py"], {}, job="j", node="n1", max_ranks=MAX_RANKS)
    )
    assert report.feed("stdout", "lanes: step 1 compute_s=0.5 wait_s=0.1 rank=1", now=100.0) == []
    assert report.feed("stdout", "lanes: step 1 compute_s=0.4 wait_s=0.2 rank=0", now=100.2) == []
    (beat,) = report.feed("stdout", "lanes: step 2 compute_s=0.5 wait_s=0.1 rank=1", now=101.5)
    assert isinstance(beat, Heartbeat)
    assert (beat.rank, beat.node, [t.step for t in beat.data.timings]) == (1, "n1", [1, 2])
    # A step line that names no rank, or a rank this run does not hold, is plain output (no evidence either).
    assert report.feed("stdout", "lanes: step 3 compute_s=0.5 wait_s=0.1", now=102.0) == []
    assert report.feed("stdout", "lanes: step 3 compute_s=0.5 wait_s=0.1 rank=7", now=103.0) == []
    (rest,) = report.finish()
    assert isinstance(rest, Heartbeat)
    assert (rest.rank, [t.step for t in rest.data.timings]) == (0, [1])
    assert report.evidence_per_rank == Counter()


def test_a_single_rank_runs_step_lines_are_its_own_without_naming_it() -> None:
    report = RunReport(identity_from(["python", "x.py"], {"RANK": "3"}, job="j", node="n1", max_ranks=MAX_RANKS))
    report.feed("stdout", "lanes: step 1 compute_s=0.5 wait_s=0.1", now=0.0)
    (rest,) = report.finish()
    assert isinstance(rest, Heartbeat)
    assert rest.rank == 3


def test_a_plain_command_is_one_rank_with_the_command_status() -> None:
    report = RunReport(identity_from(["python", "x.py"], {}, job="j", node="n1", max_ranks=MAX_RANKS))
    (exit_event,) = report.rank_exits(-9)
    assert isinstance(exit_event, RankExited)
    assert (exit_event.rank, exit_event.data.signal) == (0, 9)


def _job(**fields: Any) -> SlurmJob:
    base: dict[str, Any] = {
        "job_id": 7,
        "cluster": "lanes",
        "name": "train llm",
        "job_state": "PENDING",
        "state_reason": "None",
        "restart_cnt": 0,
        "tasks": 2,
        "user_name": "ada",
        "partition": "gpu",
        "exit_code": 0,
        "submit_time": 1796280000,
    }
    return SlurmJob.from_json(base | fields)


_RUNNING: dict[str, Any] = {
    "job_state": "RUNNING",
    "start_time": 1796280010,
    "job_resources": {"allocated_nodes": [{"nodename": "n1"}, {"nodename": "n2"}]},
}


def _fold(observations: list[SlurmJob]) -> tuple[JobView, list[Event]]:
    memory: JobMemory | None = None
    published: list[Event] = []
    view: JobView | None = None
    for job in observations:
        memory, events = observe_job(memory, job, NOW)
        published.extend(events)
        for event in events:
            view, _ = evolve(view, event)
    assert view is not None
    return view, published


def test_slurm_job_that_succeeds() -> None:
    view, events = _fold(
        [_job(), _job(**_RUNNING), _job(**_RUNNING | {"job_state": "COMPLETED", "end_time": 1796280050})]
    )
    submitted = events[0]
    assert isinstance(submitted, JobSubmitted)
    assert submitted.jobid == "slurm-lanes-7"
    assert submitted.data.spec.managed_by == "slurm"
    assert (submitted.data.spec.name, submitted.data.spec.tenant, submitted.data.spec.pool) == (
        "train-llm",
        "ada",
        "gpu",
    )
    placed = next(e for e in events if isinstance(e, JobPlaced))
    assert [(a.rank, a.node) for a in placed.data.assignments] == [(0, "n1"), (1, "n2")]
    assert view.state is JobState.RELEASED
    assert view.current.cause is not None
    assert view.current.cause.value == "normal_completion"


def test_slurm_job_that_fails_keeps_its_exit_code() -> None:
    ended = _RUNNING | {"job_state": "FAILED", "exit_code": 3 << 8, "state_reason": "NonZeroExitCode"}
    view, _ = _fold([_job(**_RUNNING), _job(**ended)])
    assert view.state is JobState.RELEASED
    assert view.current.ranks[0].exit_code == 3
    assert view.history[-2].state is JobState.FAILED


def test_requeue_becomes_the_second_attempt_of_the_same_job() -> None:
    view, events = _fold(
        [
            _job(**_RUNNING),
            _job(restart_cnt=1, state_reason="BeginTime"),
            _job(**_RUNNING | {"restart_cnt": 1}),
            _job(**_RUNNING | {"restart_cnt": 1, "job_state": "COMPLETED"}),
        ]
    )
    assert [a.number for a in view.attempts] == [1, 2]
    assert view.attempts[0].ranks[0].signal == 15
    assert view.state is JobState.RELEASED
    assert view.current.cause is not None
    assert view.current.cause.value == "normal_completion"
    retry = next(e for e in events if isinstance(e, RetryRequested))
    assert retry.attempt == 1
    assert "requeued by Slurm" in retry.data.reason


def test_pending_for_resources_then_running_keeps_every_reason() -> None:
    view, events = _fold(
        [
            _job(state_reason="Priority"),
            _job(state_reason="Resources"),
            _job(state_reason="Resources"),
            _job(**_RUNNING),
        ]
    )
    waits = [e for e in events if isinstance(e, JobWaiting)]
    assert [(w.data.reason, w.data.detail) for w in waits] == [
        ("capacity_short", "Slurm: Priority"),
        ("capacity_short", "Slurm: Resources"),
    ]
    assert waits[1].data.blocking[0].reason == "Resources"
    assert view.state is JobState.STARTING
    assert [span.state for span in view.history][:2] == [JobState.QUEUED, JobState.ADMITTED]


@pytest.mark.parametrize(
    ("code", "reason", "lane"),
    [
        ("Resources", "capacity_short", Lane.PLATFORM),
        ("ReqNodeNotAvail", "isolated", Lane.HOST),
        ("PartitionDown", "isolated", Lane.PLATFORM),
        ("QOSMaxGRESPerUser", "isolated", Lane.PLATFORM),
        ("BadConstraints", "spec_mismatch", Lane.ALGORITHM),
    ],
)
def test_pending_reasons_map_to_lanes_wait_reasons(code: str, reason: str, lane: Lane) -> None:
    mapping = wait_mapping(code)
    assert (mapping.reason, mapping.lane) == (reason, lane)


def test_cancelled_while_pending_ends_cancelled() -> None:
    view, _ = _fold([_job(state_reason="Resources"), _job(job_state="CANCELLED")])
    assert view.state is JobState.CANCELLED


def test_observing_again_publishes_nothing_new() -> None:
    memory, first = observe_job(None, _job(**_RUNNING), NOW)
    again, second = observe_job(memory, _job(**_RUNNING), NOW)
    assert first
    assert second == []
    assert again == memory
    # A producer that lost its memory (a restart) derives the same ids: JetStream stores them once.
    _, replayed = observe_job(None, _job(**_RUNNING), NOW)
    assert [e.id for e in replayed] == [e.id for e in first]


def test_drain_and_down_become_host_lane_node_events_with_their_reason() -> None:
    drained = SlurmNode.from_json({"name": "n1", "state": "idle", "state_flags": ["DRAIN"], "reason": "xid 79"})
    down = SlurmNode.from_json({"name": "n1", "state": "down", "state_flags": [], "reason": "not responding"})
    ready = SlurmNode.from_json({"name": "n1", "state": "idle", "state_flags": [], "reason": ""})
    known, events = observe_node(None, drained)
    assert isinstance(events[0], NodeStateChanged)
    assert (events[0].lane, events[0].data.state, events[0].data.reason) == (
        Lane.HOST,
        NodeState.DRAINING,
        "Slurm: xid 79",
    )
    assert observe_node(known, drained)[1] == []
    known, events = observe_node(known, down)
    assert events[0].data.state is NodeState.UNHEALTHY
    _, events = observe_node(known, ready)
    assert events[0].data.state is NodeState.READY


def test_outbox_keeps_exactly_what_was_not_sent(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "sub" / "box.ndjson")
    events = [observed.rank_started("j", 1, rank, "n1", source="tests", pid=100 + rank, time=NOW) for rank in range(3)]
    box.append(events)
    assert [decode_structured(line) for line in box.lines()] == events
    box.drop_first(2)
    assert [decode_structured(line) for line in box.lines()] == events[2:]
    box.drop_first(1)
    assert not box.path.exists()
    assert box.lines() == []
