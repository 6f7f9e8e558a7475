"""The scheduler's and the lifecycle's handlers against in-memory fakes of their ports (no servers)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from lanes_contract.events import (
    AttemptRequested,
    AttemptRequestedData,
    JobPlaced,
    JobStateChanged,
    JobStateChangedData,
    JobSubmitted,
    JobSubmittedData,
    JobWaiting,
    NodeRegistered,
    NodeRegisteredData,
    RankAssignment,
    ResourcesReleased,
    TransitionRejected,
)
from lanes_contract.jobs import JobSpec, JobState
from lanes_contract.topology import ClusterPolicy, Node, NodeStatus
from lanes_lifecycle.domain.job import JobView
from lanes_lifecycle.service_layer.handlers import apply_job_event
from lanes_runtime.consumer import TransactionScope
from lanes_scheduler.domain.admission import Gang, Holding, Placed, Waiting
from lanes_scheduler.domain.queue import PendingJob, Release, gang_of
from lanes_scheduler.service_layer.handlers import Scheduler
from lanes_scheduler.service_layer.ports import QueuedAttempt, WaitEnd, WaitUpdate

# --- scheduler -------------------------------------------------------------------------------------


@dataclass
class FakeScheduling:
    """`SchedulingRepository` in memory."""

    token: str = "initial"  # noqa: S105 - a state token, not a secret
    node_rows: dict[str, Node] = field(default_factory=dict)
    cluster_policy: ClusterPolicy = field(default_factory=ClusterPolicy)
    jobs: dict[tuple[str, int], tuple[JobSpec, int, str, tuple[str, ...]]] = field(default_factory=dict)
    allocations: dict[tuple[str, int], tuple[RankAssignment, ...]] = field(default_factory=dict)
    waits: dict[tuple[str, int], Waiting] = field(default_factory=dict)

    async def lock_scheduling(self) -> None:
        return None

    async def state_token(self) -> str:
        return self.token

    async def set_state_token(self, token: str) -> None:
        self.token = token

    async def upsert_node(self, node_id: str, data: NodeRegisteredData) -> None:
        self.node_rows[node_id] = Node(
            node_id=node_id, gpu_model=data.gpu_model, gpus=data.gpus, gpu_memory_gib=data.gpu_memory_gib
        )

    async def set_node_state(self, node_id: str, status: NodeStatus) -> bool:
        if node_id not in self.node_rows:
            return False
        self.node_rows[node_id] = self.node_rows[node_id].model_copy(update={"status": status})
        return True

    async def set_policy(self, policy: ClusterPolicy) -> None:
        self.cluster_policy = policy

    async def policy(self) -> ClusterPolicy:
        return self.cluster_policy

    async def nodes(self) -> list[Node]:
        return list(self.node_rows.values())

    async def holdings(self) -> list[Holding]:
        return [
            Holding(
                f"{job}/{attempt}", self.jobs[job, attempt][0].tenant, self.jobs[job, attempt][0].pool, a.node, a.gpus
            )
            for (job, attempt), assignments in self.allocations.items()
            for a in assignments
        ]

    async def add_pending_jobs(self, queued: Sequence[QueuedAttempt]) -> set[tuple[str, int]]:
        added = set()
        for q in queued:
            if (q.job_id, q.attempt) not in self.jobs:
                self.jobs[q.job_id, q.attempt] = (q.spec, q.seq, "pending", q.avoid_nodes)
                added.add((q.job_id, q.attempt))
        return added

    async def original_spec(self, job_id: str) -> JobSpec | None:
        found = sorted((a, v[0]) for (j, a), v in self.jobs.items() if j == job_id)
        return found[0][1] if found else None

    async def pending_jobs(self) -> list[PendingJob]:
        waiting = sorted((v[1], j, a) for (j, a), v in self.jobs.items() if v[2] == "pending")
        return [
            PendingJob(gang_of(j, a, self.jobs[j, a][0], seq, avoid_nodes=self.jobs[j, a][3]), None)
            for seq, j, a in waiting
        ]

    async def allocate(self, placed: Sequence[Placed]) -> None:
        for placement in placed:
            gang = placement.gang
            self.allocations[gang.job_id, gang.attempt] = placement.assignments
            self._status(gang.job_id, gang.attempt, "placed")

    async def reject(self, gang: Gang) -> None:
        self._status(gang.job_id, gang.attempt, "rejected")

    async def release(self, job_id: str, attempt: int, cause_id: str, at: datetime) -> Release:
        del cause_id, at
        if (job_id, attempt) not in self.jobs:
            return Release("unknown_attempt")
        if self.jobs[job_id, attempt][2] == "done":
            return Release("double_release")
        self._status(job_id, attempt, "done")
        freed = self.allocations.pop((job_id, attempt), ())
        return Release("released", tuple(sorted({a.node for a in freed})), sum(len(a.gpus) for a in freed))

    async def close_waits(self, ended: Sequence[WaitEnd]) -> None:
        for end in ended:
            self.waits.pop((end.job_id, end.attempt), None)

    async def record_waits(self, updates: Sequence[WaitUpdate]) -> None:
        for update in updates:
            self.waits[update.waiting.gang.job_id, update.waiting.gang.attempt] = update.waiting

    def _status(self, job_id: str, attempt: int, status: str) -> None:
        spec, seq, _, avoid = self.jobs[job_id, attempt]
        self.jobs[job_id, attempt] = (spec, seq, status, avoid)


@dataclass
class FakeSchedulerUnit:
    repo: FakeScheduling
    stream_seq: int = 0
    batch: TransactionScope | None = None


H100_NODE = NodeRegisteredData(gpu_model="H100", gpus=8, gpu_memory_gib=80)


def _submitted(job_id: str, gpus: int = 8, priority: int = 0) -> JobSubmitted:
    spec = JobSpec(name=job_id, workers=1, gpus_per_worker=gpus, priority=priority)
    return JobSubmitted(source="tests", jobid=job_id, attempt=1, data=JobSubmittedData(spec=spec))


def _finished(job_id: str) -> JobStateChanged:
    data = JobStateChangedData(from_state=JobState.RUNNING, to_state=JobState.SUCCEEDED, cause_type="x", sequence=9)
    return JobStateChanged(source="tests", jobid=job_id, attempt=1, data=data)


async def test_the_scheduler_places_queues_and_places_again_after_a_release() -> None:
    repo = FakeScheduling()
    scheduler = Scheduler()
    node = NodeRegistered(
        source="tests", node="n1", data=NodeRegisteredData(gpu_model="H100", gpus=8, gpu_memory_gib=80)
    )
    await scheduler.apply_node_event(node, FakeSchedulerUnit(repo, 1))

    (placed,) = await scheduler.apply_job_event(_submitted("a"), FakeSchedulerUnit(repo, 2))
    assert isinstance(placed, JobPlaced)
    assert [a.node for a in placed.data.assignments] == ["n1"]
    (waiting,) = await scheduler.apply_job_event(_submitted("b"), FakeSchedulerUnit(repo, 3))
    assert isinstance(waiting, JobWaiting)
    assert waiting.data.reason == "capacity_short"
    assert await scheduler.apply_job_event(_submitted("b"), FakeSchedulerUnit(repo, 4)) == []  # a duplicate

    freed, placed_b = await scheduler.apply_job_event(_finished("a"), FakeSchedulerUnit(repo, 5))
    assert isinstance(freed, ResourcesReleased)
    assert freed.data.gpus == 8
    assert isinstance(placed_b, JobPlaced)
    assert placed_b.jobid == "b"
    assert await scheduler.apply_job_event(_finished("a"), FakeSchedulerUnit(repo, 6)) == []  # released once


async def test_a_scheduler_does_not_reuse_its_cache_after_another_writer_changed_the_state() -> None:
    repo = FakeScheduling()
    mine, other = Scheduler(), Scheduler()
    node = NodeRegistered(
        source="tests", node="n1", data=NodeRegisteredData(gpu_model="H100", gpus=8, gpu_memory_gib=80)
    )
    await mine.apply_node_event(node, FakeSchedulerUnit(repo, 1))
    await mine.apply_job_event(_submitted("a", gpus=4), FakeSchedulerUnit(repo, 2))
    await other.apply_job_event(_submitted("b", gpus=4), FakeSchedulerUnit(repo, 3))  # takes the other half
    (waiting,) = await mine.apply_job_event(_submitted("c", gpus=4), FakeSchedulerUnit(repo, 4))
    assert isinstance(waiting, JobWaiting)  # `mine` reloaded: its cached view still showed 4 GPUs free


async def _scheduler_with_one_node() -> tuple[FakeScheduling, Scheduler]:
    """A scheduler on a fake repository that knows one 8-GPU node, `n1` (its event at stream sequence 1)."""
    repo = FakeScheduling()
    scheduler = Scheduler()
    await scheduler.apply_node_event(
        NodeRegistered(source="tests", node="n1", data=H100_NODE), FakeSchedulerUnit(repo, 1)
    )
    return repo, scheduler


async def test_in_a_batch_the_queue_is_decided_once_after_the_last_event_in_priority_order() -> None:
    repo, scheduler = await _scheduler_with_one_node()
    batch = TransactionScope(deferred=True)
    arrivals = [
        _submitted("low", gpus=4),
        _submitted("mid", gpus=4, priority=5),
        _submitted("high", gpus=4, priority=9),
    ]
    for seq, event in enumerate(arrivals, start=2):
        assert await scheduler.apply_job_event(event, FakeSchedulerUnit(repo, seq, batch)) == []  # decided later
    decided = await batch.flush()

    outputs = {output.jobid: (cause, output) for cause, output in decided}
    assert {job: type(output) for job, (_, output) in outputs.items()} == {
        "high": JobPlaced,
        "mid": JobPlaced,
        "low": JobWaiting,  # it arrived first, but the batch's higher priorities took the node's 8 GPUs
    }
    for cause, output in outputs.values():
        assert cause.jobid == output.jobid  # each decision derives from its own submission (one trace)
        assert output.causationid == cause.id
    assert len(repo.waits) == 1

    release = TransactionScope(deferred=True)
    (freed,) = await scheduler.apply_job_event(_finished("high"), FakeSchedulerUnit(repo, 5, release))
    assert isinstance(freed, ResourcesReleased)
    ((cause, placed),) = await release.flush()
    assert (placed.jobid, type(placed), cause.jobid) == ("low", JobPlaced, "high")  # the release let it run


async def test_a_batch_that_changed_nothing_keeps_the_state_for_the_next() -> None:
    repo, scheduler = await _scheduler_with_one_node()
    await scheduler.apply_job_event(_submitted("a"), FakeSchedulerUnit(repo, 2))
    token = await repo.state_token()
    batch = TransactionScope(deferred=True)
    assert await scheduler.apply_job_event(_submitted("a"), FakeSchedulerUnit(repo, 3, batch)) == []  # a duplicate
    assert await batch.flush() == []
    assert await repo.state_token() == token  # no decision, no new token
    assert scheduler._states.keys() == {token}


async def test_in_a_batch_an_attempt_or_a_release_sees_the_submissions_queued_before_it() -> None:
    # Submissions are written together, at the batch's end or before anything that reads them: an attempt
    # finds its job's spec, and a job submitted and finished in one batch is freed, not left queued.
    repo, scheduler = await _scheduler_with_one_node()
    batch = TransactionScope(deferred=True)
    retry = AttemptRequested(source="tests", jobid="a", attempt=2, data=AttemptRequestedData(reason="retry"))
    events = [_submitted("a", gpus=4), retry, _submitted("b", gpus=4), _finished("b"), _submitted("c", gpus=4)]
    for seq, event in enumerate(events, start=2):
        await scheduler.apply_job_event(event, FakeSchedulerUnit(repo, seq, batch))
    decided = {(output.jobid, output.attempt): type(output) for _, output in await batch.flush()}
    assert decided == {("a", 1): JobPlaced, ("a", 2): JobPlaced, ("c", 1): JobWaiting}
    assert repo.jobs["a", 2][0] == repo.jobs["a", 1][0]  # the attempt runs the job's own spec
    assert repo.jobs["b", 1][2] == "done"


# --- lifecycle -------------------------------------------------------------------------------------


@dataclass
class FakeJobs:
    views: dict[str, JobView] = field(default_factory=dict)
    log: list[JobStateChanged] = field(default_factory=list)
    """Every job's state changes, in the order they were appended."""

    async def load(self, job_id: str) -> JobView | None:
        return self.views.get(job_id)

    async def save(self, view: JobView, *, transition: JobStateChanged | None = None) -> None:
        if transition is not None:
            self.log.append(transition)
        self.views[view.job_id] = view


@dataclass
class FakeLifecycleUnit:
    jobs: FakeJobs = field(default_factory=FakeJobs)


async def test_the_lifecycle_saves_each_view_with_the_state_change_that_led_to_it() -> None:
    uow = FakeLifecycleUnit()
    job_id = f"j{uuid.uuid4().hex[:6]}"
    assert await apply_job_event(_submitted(job_id), uow) == []
    placed = JobPlaced(
        source="tests",
        jobid=job_id,
        attempt=1,
        data={"assignments": (RankAssignment(rank=0, node="n1", gpus=(0,)),)},  # type: ignore[arg-type]
    )
    await apply_job_event(placed, uow)
    assert [c.data.to_state for c in uow.jobs.log] == [JobState.QUEUED, JobState.ADMITTED]
    assert [c.data.sequence for c in uow.jobs.log] == [1, 2]
    assert uow.jobs.views[job_id].state is JobState.ADMITTED


async def test_an_event_the_job_state_forbids_is_rejected_visibly_not_raised() -> None:
    uow = FakeLifecycleUnit()
    stray = JobPlaced(
        source="tests",
        jobid="never-submitted",
        attempt=1,
        data={"assignments": (RankAssignment(rank=0, node="n1", gpus=(0,)),)},  # type: ignore[arg-type]
    )
    (rejected,) = await apply_job_event(stray, uow)
    assert isinstance(rejected, TransitionRejected)
    assert "never submitted" in rejected.data.reason
    assert uow.jobs.views == {}
    assert uow.jobs.log == []
