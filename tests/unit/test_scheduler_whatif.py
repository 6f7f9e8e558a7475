"""`lanes whatif scheduler`: the scheduler's handlers replay a log as recorded and against a changed cluster.

Hand-written logs (nodes, submissions, ends, and the scheduler decisions the log records) test the replay
check, a changed topology, quotas and priorities; an imported openb trace tests the deltas and, with random
traces, that no GPU is ever given to two attempts at once (checked from the placements, not by the code under
test); the committed corpus (`tests/data/whatif/`) fails with the diff when a change alters a past decision.
"""

from __future__ import annotations

import itertools
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from lanes_cli import trace_cli, whatif_cli
from lanes_cli.traces import import_openb
from lanes_contract.events import (
    Event,
    JobPlaced,
    JobPlacedData,
    JobStateChanged,
    JobStateChangedData,
    JobSubmitted,
    JobSubmittedData,
    JobWaiting,
    JobWaitingData,
    NodeRegistered,
    NodeRegisteredData,
    RankAssignment,
)
from lanes_contract.jobs import JobSpec, JobState
from lanes_contract.topology import ClusterPolicy, Node, Tenant
from lanes_scheduler.entrypoints.whatif import AttemptRun
from lanes_scheduler.views import Changes, PriorityChanges, SchedulerWhatIf, replay_scheduler

DATA = Path(__file__).resolve().parents[1] / "data"
T0 = datetime(2026, 1, 1, tzinfo=UTC)
SCHEDULER = "lanes/scheduler"
runner = CliRunner()


def _app() -> typer.Typer:
    root = typer.Typer()
    whatif_cli.register(root)
    trace_cli.register(root)

    @root.callback()
    def _root() -> None:
        """The two command groups under test."""

    return root


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def node(node_id: str, gpus: int = 8) -> NodeRegistered:
    data = NodeRegisteredData(gpu_model="H100", gpus=gpus, gpu_memory_gib=80)
    return NodeRegistered(source="lanes/topology", node=node_id, time=T0, data=data)


def submit(job: str, seconds: float, gpus: int = 8, **spec: Any) -> JobSubmitted:
    data = JobSubmittedData(spec=JobSpec(name=job, workers=1, gpus_per_worker=gpus, **spec))
    return JobSubmitted(source="lanes/cli", jobid=job, attempt=1, time=at(seconds), data=data)


def state(job: str, seconds: float, to: JobState) -> JobStateChanged:
    data = JobStateChangedData(from_state=None, to_state=to, cause_type="test")
    return JobStateChanged(source="lanes/lifecycle", jobid=job, attempt=1, time=at(seconds), data=data)


def placed(job: str, seconds: float, where: str, gpus: range) -> JobPlaced:
    data = JobPlacedData(assignments=(RankAssignment(rank=0, node=where, gpus=tuple(gpus)),))
    return JobPlaced(source=SCHEDULER, jobid=job, attempt=1, time=at(seconds), data=data)


def waiting(job: str, seconds: float, reason: str) -> JobWaiting:
    return JobWaiting(source=SCHEDULER, jobid=job, attempt=1, time=at(seconds), data=JobWaitingData(reason=reason))


def two_jobs_one_node() -> list[Event]:
    """Job a holds the only node for 100 s; b, submitted at 10 s, waits for it and then runs 50 s."""
    return [
        node("n1"),
        submit("a", 0),
        placed("a", 0, "n1", range(8)),
        state("a", 0, JobState.RUNNING),
        submit("b", 10),
        waiting("b", 10, "capacity_short"),
        state("a", 100, JobState.SUCCEEDED),
        placed("b", 100, "n1", range(8)),
        state("b", 100, JobState.RUNNING),
        state("b", 150, JobState.SUCCEEDED),
    ]


async def test_the_logs_own_cluster_reproduces_every_recorded_decision_and_says_so() -> None:
    result = (await replay_scheduler(two_jobs_one_node())).as_json()

    assert result["replay_check"] == {"recorded": 2, "reproduced": 2, "differences": []}
    assert result["diff"] == []
    assert result["queue_wait_p99_s"]["old"] == 90.0  # b waited from 10 s to 100 s
    assert result["wait_reasons"]["old"] == {"capacity_short": 1}


async def test_a_recorded_decision_the_replay_does_not_make_is_named_with_both_sides() -> None:
    events = two_jobs_one_node()
    events[7] = placed("b", 100, "n2", range(8))

    check = (await replay_scheduler(events)).replay_check()

    assert check["recorded"] == 2
    assert check["reproduced"] == 1
    (miss,) = check["differences"]
    assert miss["job_id"] == "b"
    assert miss["recorded"]["placement"] == [{"node": "n2", "gpus": list(range(8))}]
    assert miss["replayed"]["placement"] == [{"node": "n1", "gpus": list(range(8))}]


async def test_a_second_node_places_the_waiting_job_at_once_and_the_deltas_say_so() -> None:
    bigger = (Node(node_id="n1", gpu_model="H100", gpus=8), Node(node_id="n2", gpu_model="H100", gpus=8))

    result = (await replay_scheduler(two_jobs_one_node(), Changes(nodes=bigger))).as_json()

    (change,) = result["diff"]
    assert change["job_id"] == "b"
    assert change["old"]["wait_s"] == 90.0
    assert change["old"]["reasons"] == ["capacity_short"]
    assert change["new"]["wait_s"] == 0.0
    assert change["new"]["placement"] == [{"node": "n2", "gpus": list(range(8))}]
    assert result["queue_wait_p99_s"] == {"old": 90.0, "new": 0.0, "delta": -90.0}
    assert result["wait_reasons"] == {"old": {"capacity_short": 1}, "new": {}}
    assert result["double_booked"] == {"old": 0, "new": 0}
    assert result["replay"]["gpus"] == {"old": 8, "new": 16}


async def test_a_job_that_now_waits_longer_also_ends_later_by_its_recorded_running_time() -> None:
    """With half the GPUs, b waits for a; a third job c, placed after b, is pushed back in turn."""
    events = [
        node("n1"),
        submit("a", 0, gpus=4),
        state("a", 0, JobState.RUNNING),
        submit("b", 0, gpus=4),
        state("b", 0, JobState.RUNNING),
        state("a", 100, JobState.SUCCEEDED),
        state("b", 60, JobState.SUCCEEDED),
    ]
    smaller = (Node(node_id="n1", gpu_model="H100", gpus=4),)

    result = await replay_scheduler(events, Changes(nodes=smaller))

    b = result.new.attempts["b", 1]
    assert b.placed_at == at(100)
    assert b.ended_at == at(160)  # it still runs its recorded 60 s
    assert result.as_json()["utilisation"]["new"] == 1.0


async def test_a_higher_priority_for_a_tenant_moves_its_job_ahead() -> None:
    events = [
        node("n1"),
        submit("a", 0),
        state("a", 0, JobState.RUNNING),
        submit("b", 10),
        submit("c", 20, tenant="urgent"),
        state("a", 100, JobState.SUCCEEDED),
        state("b", 100, JobState.RUNNING),
        state("b", 150, JobState.SUCCEEDED),
        state("c", 150, JobState.RUNNING),
        state("c", 200, JobState.SUCCEEDED),
    ]
    changes = Changes(priorities=PriorityChanges(tenants={"urgent": 10}))

    result = await replay_scheduler(events, changes)

    assert result.old.attempts["b", 1].placed_at == at(100)
    assert result.old.attempts["c", 1].placed_at == at(150)
    assert result.new.attempts["c", 1].placed_at == at(100)
    assert result.new.attempts["b", 1].placed_at == at(150)
    assert {(c["job_id"]) for c in result.diff()} == {"b", "c"}


async def test_a_quota_makes_a_tenant_wait_as_isolated() -> None:
    events = [node("n1"), submit("a", 0, tenant="small"), state("a", 0, JobState.RUNNING)]
    quotas = ClusterPolicy(tenants=(Tenant(name="small", gpu_quota={"default": 4}),))

    result = (await replay_scheduler(events, Changes(policy=quotas))).as_json()

    assert result["placed"] == {"old": 1, "new": 0, "delta": -1}
    assert result["wait_reasons"]["new"] == {"isolated": 1}


def _overlaps(attempts: dict[tuple[str, int], AttemptRun], end: datetime) -> list[str]:
    """GPUs held by two attempts over overlapping intervals, from the placements alone."""
    intervals: dict[tuple[str, int], list[tuple[datetime, datetime, str]]] = {}
    for (job, attempt), run in attempts.items():
        if run.placed_at is None:
            continue
        for where, gpus in run.assignments:
            for gpu in gpus:
                intervals.setdefault((where, gpu), []).append((run.placed_at, run.ended_at or end, f"{job}/{attempt}"))
    clashes = []
    for device, held in intervals.items():
        held.sort()
        for (_, first_end, first), (second_start, _, second) in itertools.pairwise(held):
            if second_start < first_end:
                clashes.append(f"{device}: {first} and {second}")
    return clashes


def _never_double_booked(result: SchedulerWhatIf) -> None:
    _, end = result.span
    assert end is not None
    for run in (result.old, result.new):
        assert _overlaps(run.attempts, end) == []
        assert run.double_booked == 0


async def test_an_imported_openb_trace_on_fewer_nodes_reports_the_deltas_and_never_double_books() -> None:
    pods = (DATA / "traces" / "openb_pod_list_sample.csv").read_text()
    nodes = (DATA / "traces" / "openb_node_list_sample.csv").read_text()
    trace = import_openb(pods, nodes)
    fewer = (
        Node(node_id="openb-node-0001", gpu_model="V100M32", gpus=8),
        Node(node_id="openb-node-0003", gpu_model="T4", gpus=4),
    )

    result = await replay_scheduler(trace.events, Changes(nodes=fewer))
    report = result.as_json()

    _never_double_booked(result)
    assert report["jobs"] == trace.jobs
    assert report["placed"]["new"] < report["placed"]["old"]
    assert report["queue_wait_p99_s"]["new"] > report["queue_wait_p99_s"]["old"]
    assert report["diff"]
    assert report["replay"]["gpus"] == {"old": 22, "new": 12}


_POD_HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time"
)


@st.composite
def traces(draw: st.DrawFn) -> tuple[str, str]:
    nodes = draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=4))
    node_rows = [f"n{i},1000,1000,{gpus},{draw(st.sampled_from(['A', 'B']))}" for i, gpus in enumerate(nodes)]
    pod_rows = []
    for i in range(draw(st.integers(1, 12))):
        created = draw(st.integers(0, 100))
        scheduled = created + draw(st.integers(0, 50))
        deleted = scheduled + draw(st.integers(1, 200))
        gpus = draw(st.sampled_from([1, 2, 4, 8]))
        model = draw(st.sampled_from(["", "A", "B"]))
        qos = draw(st.sampled_from(["LS", "BE"]))
        pod_rows.append(f"p{i},0,0,{gpus},1000,{model},{qos},Succeeded,{created},{deleted},{scheduled}")
    return "\n".join([_POD_HEADER, *pod_rows]), "\n".join(["sn,cpu_milli,memory_mib,gpu,model", *node_rows])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces(), keep=st.integers(1, 4), priority=st.integers(-5, 5))
async def test_no_gpu_is_ever_given_to_two_attempts_at_once(trace: tuple[str, str], keep: int, priority: int) -> None:
    imported = import_openb(*trace)
    kept = tuple(
        Node(node_id=e.node or "", gpu_model=e.data.gpu_model, gpus=e.data.gpus)
        for e in imported.events
        if isinstance(e, NodeRegistered)
    )[:keep]
    changes = Changes(nodes=kept, priorities=PriorityChanges(tenants={"ls": priority}))

    result = await replay_scheduler(imported.events, changes)

    _never_double_booked(result)
    for run in (*result.old.attempts.values(), *result.new.attempts.values()):
        assert run.placed_at is None or run.queued_at <= run.placed_at <= (run.ended_at or run.placed_at)


def test_the_command_prints_the_named_fields_and_the_check(tmp_path: Path) -> None:
    log = tmp_path / "trace.ndjson"
    pods, nodes = DATA / "traces" / "openb_pod_list_sample.csv", DATA / "traces" / "openb_node_list_sample.csv"
    imported = runner.invoke(
        _app(), ["trace", "import", str(pods), "--nodes", str(nodes), "--format", "openb", "--out", str(log)]
    )
    assert imported.exit_code == 0, imported.output

    result = runner.invoke(_app(), ["whatif", "scheduler", "--from", str(log), "--json"])

    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    for name in (
        "jobs",
        "placed",
        "unexpressed",
        "double_booked",
        "utilisation",
        "queue_wait_p50_s",
        "queue_wait_p99_s",
        "fragmentation",
        "wait_reasons",
        "diff",
    ):
        assert name in body
    assert body["diff"] == []
    text = runner.invoke(_app(), ["whatif", "scheduler", "--from", str(log)])
    assert "no job placed or waited differently" in text.output


def test_a_malformed_quotas_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    quotas = tmp_path / "quotas.yaml"
    quotas.write_text("tenants:\n  - name: a\n    gpu_quota: {default: many}\n")
    log = tmp_path / "log.ndjson"
    log.write_text("")

    result = runner.invoke(_app(), ["whatif", "scheduler", "--from", str(log), "--quotas", str(quotas)])

    assert result.exit_code == 2
    assert "quotas.yaml" in result.output
    assert "gpu_quota" in result.output


def test_the_committed_corpus_replays_to_its_recorded_result() -> None:
    """A change to the scheduler that alters a past decision fails here with the diff; re-record on purpose."""
    corpus = DATA / "whatif"
    args = ["whatif", "scheduler", "--from", str(corpus / "openb-sample.ndjson")]
    args += ["--topology", str(corpus / "openb-sample-fewer-nodes.yaml"), "--json"]

    result = runner.invoke(_app(), args)

    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == json.loads((corpus / "openb-sample.expected.json").read_text())


async def test_an_attempt_submitted_before_the_log_begins_is_counted_as_unexpressed() -> None:
    events = [node("n1"), state("early", 5, JobState.RUNNING), state("early", 50, JobState.SUCCEEDED), submit("a", 10)]

    result = (await replay_scheduler(events)).as_json()

    assert result["unexpressed"] == 1
    assert result["unexpressed_by_kind"] == {"attempts_queued_before_the_log": 1}
    assert result["jobs"] == 1
