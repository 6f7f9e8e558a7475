"""The Slurm adapter: Slurm's jobs and nodes on the Lanes timeline, without replacing Slurm.

Source of state: polling `squeue --json` and `sinfo --json` (Slurm 22.05 has both through its JSON
serializer; `sacct` needs slurmdbd, which many clusters and this adapter do without). Polling needs no
change to the cluster's configuration (strigger, prolog and epilog hooks do) and sees every transition
that lasts longer than the poll interval, including jobs that already ended (squeue keeps them for
MinJobAge). Each observation is compared with what the adapter saw before and becomes job events:

- a new job: `submitted` (spec with `managed_by: slurm`, so Lanes' scheduler never places it);
- a pending reason: `waiting`, mapped to Lanes' wait reasons, Slurm's own code kept in the detail and in
  the blocking resource; every change is kept on the timeline, which Slurm itself forgets;
- running: `placed` (tasks spread over the allocated nodes as Slurm's block distribution does) and each
  rank's start;
- a requeue (restart count up): the running attempt's ranks stopped, its allocation released, and a retry
  that opens the next attempt of the same job;
- the end: each rank's exit from the job's state and exit status (`lanes run` inside the job reports each
  task's own exit first, and the first report of a rank's exit is the one kept), then the release.

Node states (DRAIN, DOWN with their reason) become node events owned by the host lane.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Literal

import structlog

from lanes_contract.events import (
    BlockingResource,
    CancelRequested,
    CommandData,
    Event,
    JobRejected,
    JobRejectedData,
    JobWaiting,
    JobWaitingData,
    Lane,
    NodeStateChanged,
    NodeStateChangedData,
    RankAssignment,
    RankExitedData,
    RetryData,
    RetryRequested,
)
from lanes_contract.ids import derived_event_id
from lanes_contract.topology import NodeState
from lanes_observe import observed
from lanes_observe.outbox import Outbox, Sender
from lanes_observe.wrap import slurm_job_id

MANAGED_BY = "slurm"
SOURCE = "lanes-slurm"
log = structlog.get_logger(__name__)

PENDING = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"})
RUNNING = frozenset({"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT"})
ENDED = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)


@dataclass(frozen=True)
class WaitMapping:
    """A Slurm pending reason as a Lanes wait reason: who can unblock it, and what blocks."""

    reason: str
    lane: Lane
    kind: Literal["node", "quota", "pool", "reservation", "capacity"]


_CAPACITY = WaitMapping("capacity_short", Lane.PLATFORM, "capacity")
_NODES = WaitMapping("isolated", Lane.HOST, "node")
_PARTITION = WaitMapping("isolated", Lane.PLATFORM, "pool")
_QUOTA = WaitMapping("isolated", Lane.PLATFORM, "quota")
_SPEC = WaitMapping("spec_mismatch", Lane.ALGORITHM, "pool")
_HELD = WaitMapping("held", Lane.ALGORITHM, "reservation")
WAIT_REASONS: Mapping[str, WaitMapping] = {
    "Resources": _CAPACITY,
    "Priority": _CAPACITY,
    "ReqNodeNotAvail": _NODES,
    "NodeDown": _NODES,
    "PartitionDown": _PARTITION,
    "PartitionInactive": _PARTITION,
    "PartitionTimeLimit": _SPEC,
    "PartitionNodeLimit": _SPEC,
    "PartitionConfig": _SPEC,
    "BadConstraints": _SPEC,
    "InvalidQOS": _SPEC,
    "InvalidAccount": _SPEC,
    "Reservation": _HELD,
    "Dependency": _HELD,
    "BeginTime": _HELD,
    "JobHeldUser": _HELD,
    "JobHeldAdmin": _HELD,
}
"""Slurm's pending reasons by code. QOS and association limits (QOSMax..., AssocGrp...) are quotas."""


def wait_mapping(code: str) -> WaitMapping:
    """The Lanes wait reason of a Slurm pending reason (a quota for QOS / association limits)."""
    if code in WAIT_REASONS:
        return WAIT_REASONS[code]
    if code.startswith(("QOS", "Assoc", "MaxCpu", "MaxGRES", "MaxNode")):
        return _QUOTA
    return _CAPACITY


def _time(value: Any) -> datetime | None:
    return datetime.fromtimestamp(value, UTC) if isinstance(value, int) and value > 0 else None


@dataclass(frozen=True)
class SlurmJob:
    """What `squeue --json` says about one job."""

    slurm_id: int
    cluster: str
    name: str
    state: str
    reason: str
    restart_count: int
    nodes: tuple[str, ...]
    tasks: int
    user: str
    partition: str
    exit_status: int
    submitted_at: datetime | None
    started_at: datetime | None
    ended_at: datetime | None

    @property
    def job_id(self) -> str:
        """Its Lanes job id, the one `lanes run` inside the job uses too."""
        return slurm_job_id(self.cluster, self.slurm_id)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> SlurmJob:
        """One entry of `squeue --json`'s `jobs`."""
        allocated = (raw.get("job_resources") or {}).get("allocated_nodes") or []
        return cls(
            slurm_id=int(raw["job_id"]),
            cluster=str(raw.get("cluster") or ""),
            name=str(raw.get("name") or "slurm-job"),
            state=str(raw.get("job_state") or "PENDING"),
            reason=str(raw.get("state_reason") or "None"),
            restart_count=int(raw.get("restart_cnt") or 0),
            nodes=tuple(str(node["nodename"]) for node in allocated if node.get("nodename")),
            tasks=int(raw.get("tasks") or 1),
            user=str(raw.get("user_name") or "default"),
            partition=str(raw.get("partition") or "default"),
            exit_status=int(raw.get("exit_code") or 0),
            submitted_at=_time(raw.get("submit_time")),
            started_at=_time(raw.get("start_time")),
            ended_at=_time(raw.get("end_time")),
        )


@dataclass(frozen=True)
class JobMemory:
    """What the adapter has already published about one job."""

    attempt: int = 1
    placement: tuple[RankAssignment, ...] = ()
    ended: bool = False
    reason: str | None = None
    waits: int = 0


def _exit_of(job: SlurmJob) -> RankExitedData:
    """A rank's end as the job's final state and wait status say it."""
    if job.state == "COMPLETED":
        return RankExitedData(exit_code=0)
    if job.state in {"NODE_FAIL", "BOOT_FAIL"}:
        return RankExitedData(exit_code=None, signal=signal.SIGKILL)
    if job.state in {"CANCELLED", "TIMEOUT", "PREEMPTED", "DEADLINE"}:
        return observed.STOPPED
    killed_by = job.exit_status & 0x7F
    if killed_by:
        return RankExitedData(exit_code=None, signal=killed_by)
    return RankExitedData(exit_code=(job.exit_status >> 8) or 1)


def _ranks_end(job: SlurmJob, memory: JobMemory, data: RankExitedData, time: datetime | None) -> list[Event]:
    job_id, attempt = job.job_id, memory.attempt
    events: list[Event] = [
        observed.rank_exited(job_id, attempt, a.rank, a.node, data, source=SOURCE, time=time) for a in memory.placement
    ]
    nodes = [a.node for a in memory.placement]
    events.append(observed.released(job_id, attempt, nodes, source=SOURCE, time=time))
    return events


def observe_job(memory: JobMemory | None, job: SlurmJob, now: datetime) -> tuple[JobMemory, list[Event]]:
    """What changed since `memory`, as events; pure."""
    events: list[Event] = []
    job_id = job.job_id
    if memory is None:
        memory = JobMemory()
        spec = observed.observed_spec(
            job.name, workers=job.tasks, managed_by=MANAGED_BY, tenant=job.user, pool=job.partition
        )
        events.append(observed.submitted(job_id, spec, source=SOURCE, time=job.submitted_at or now))
    while memory.attempt < job.restart_count + 1:  # requeued: the running attempt ends, the next one opens
        if memory.placement and not memory.ended:
            events.extend(_ranks_end(job, memory, observed.STOPPED, now))
        retry = RetryData(reason=f"requeued by Slurm (restart {memory.attempt})", requested_by=MANAGED_BY)
        events.append(
            observed.observed_event(RetryRequested, job_id=job_id, attempt=memory.attempt, source=SOURCE, data=retry)
        )
        memory = JobMemory(attempt=memory.attempt + 1, waits=memory.waits)
    attempt = memory.attempt
    if job.state in PENDING and job.reason not in {"None", ""} and job.reason != memory.reason:
        mapping = wait_mapping(job.reason)
        blocking = BlockingResource(kind=mapping.kind, id=job.partition, reason=job.reason, owner_lane=mapping.lane)
        waiting = JobWaitingData(
            reason=mapping.reason, detail=f"Slurm: {job.reason}", owner_lane=mapping.lane, blocking=(blocking,)
        )
        key = f"{memory.waits}:{job.reason}"
        events.append(
            observed.observed_event(
                JobWaiting, job_id=job_id, attempt=attempt, source=SOURCE, key=key, time=now, data=waiting
            )
        )
        memory = replace(memory, reason=job.reason, waits=memory.waits + 1)
    if (job.state in RUNNING or job.state in ENDED) and job.nodes and not memory.placement:
        placement = observed.block_placement(job.nodes, job.tasks)
        started = job.started_at or now
        events.append(observed.placed(job_id, attempt, placement, source=SOURCE, time=started))
        events.extend(
            observed.rank_started(job_id, attempt, a.rank, a.node, source=SOURCE, time=started) for a in placement
        )
        memory = replace(memory, placement=placement, reason=None)
    if job.state in ENDED and not memory.ended:
        ended_at = job.ended_at or now
        if job.state == "CANCELLED":
            cancel = CommandData(reason="cancelled in Slurm (scancel)", requested_by=MANAGED_BY)
            events.append(
                observed.observed_event(
                    CancelRequested, job_id=job_id, attempt=attempt, source=SOURCE, time=ended_at, data=cancel
                )
            )
        if memory.placement:
            events.extend(_ranks_end(job, memory, _exit_of(job), ended_at))
        elif job.state != "CANCELLED":
            never_ran = JobRejectedData(reason=f"slurm_{job.state.lower()}", detail=f"Slurm: {job.state} {job.reason}")
            events.append(
                observed.observed_event(JobRejected, job_id=job_id, attempt=attempt, source=SOURCE, data=never_ran)
            )
        memory = replace(memory, ended=True)
    return memory, events


# --- nodes -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlurmNode:
    """What `sinfo --json` says about one node."""

    name: str
    state: NodeState
    reason: str

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> SlurmNode:
        """One entry of `sinfo --json`'s `nodes`: DOWN is unhealthy, DRAIN(ED/ING) draining, else ready."""
        base = str(raw.get("state") or "").upper()
        flags = {str(flag).upper() for flag in raw.get("state_flags") or ()}
        if base.startswith("DOWN") or "NOT_RESPONDING" in flags or base == "FAIL":
            state = NodeState.UNHEALTHY
        elif "DRAIN" in flags or base.startswith("DRAIN"):
            state = NodeState.DRAINING
        else:
            state = NodeState.READY
        reason = str(raw.get("reason") or "") if state is not NodeState.READY else ""
        return cls(name=observed.token(str(raw["name"])), state=state, reason=reason)


def observe_node(
    known: tuple[NodeState, str, int] | None, node: SlurmNode
) -> tuple[tuple[NodeState, str, int], list[Event]]:
    """A node event when the node's state or reason changed; `known` is (state, reason, changes so far)."""
    if known is not None and known[:2] == (node.state, node.reason):
        return known, []
    changes = known[2] + 1 if known else 1
    event = NodeStateChanged(
        id=derived_event_id(f"slurm-node/{node.name}", "io.lanes.node.state_changed.v1", f"{changes}:{node.state}"),
        source=SOURCE,
        node=node.name,
        lane=Lane.HOST,
        data=NodeStateChangedData(state=node.state, reason=f"Slurm: {node.reason}" if node.reason else ""),
    )
    return (node.state, node.reason, changes), [event]


# --- the poller ------------------------------------------------------------------------------------


@dataclass
class SlurmWatch:
    """Polls squeue and sinfo, publishes what changed through an outbox (Lanes down loses nothing)."""

    outbox: Outbox
    sender: Sender
    env: Mapping[str, str] | None = None
    jobs: dict[int, JobMemory] = field(default_factory=dict)
    nodes: dict[str, tuple[NodeState, str, int]] = field(default_factory=dict)

    async def _json(self, *command: str) -> dict[str, Any]:
        try:
            proc = await asyncio.create_subprocess_exec(
                *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=self.env
            )
        except FileNotFoundError as exc:
            msg = f"{command[0]} is not on PATH: the watch runs where Slurm's clients are installed"
            raise RuntimeError(msg) from exc
        out, err = await proc.communicate()
        if proc.returncode != 0:
            msg = f"{' '.join(command)} failed ({proc.returncode}): {err.decode(errors='replace').strip()}"
            raise RuntimeError(msg)
        parsed = json.loads(out)
        if not isinstance(parsed, dict):
            msg = f"{' '.join(command)}: expected a JSON object, got {type(parsed).__name__}"
            raise ValueError(msg)  # noqa: TRY004 - output a failed poll reports, as a malformed value
        return parsed

    async def poll_once(self) -> list[Event]:
        """One observation of every job and node; the events are in the outbox (and sent when possible)."""
        now = datetime.now(UTC)
        queue = await self._json("squeue", "--json", "--all")
        info = await self._json("sinfo", "--json")
        events: list[Event] = []
        try:
            for raw in info.get("nodes") or ():
                node = SlurmNode.from_json(raw)
                self.nodes[node.name], found = observe_node(self.nodes.get(node.name), node)
                events.extend(found)
            for raw in sorted(queue.get("jobs") or (), key=lambda j: int(j["job_id"])):
                job = SlurmJob.from_json(raw)
                self.jobs[job.slurm_id], found = observe_job(self.jobs.get(job.slurm_id), job, now)
                events.extend(found)
        except (KeyError, TypeError, AttributeError) as exc:  # another Slurm version's JSON: a failed poll
            msg = f"squeue/sinfo --json: unexpected output ({type(exc).__name__}: {exc})"
            raise ValueError(msg) from exc
        self.outbox.append(events)
        await self.sender.send()
        return events

    async def run(self, stop: asyncio.Event, interval_s: float) -> None:
        """Poll until `stop` is set; a failed poll (slurmctld down) is logged and retried."""
        while not stop.is_set():
            try:
                await self.poll_once()
            except (RuntimeError, OSError, ValueError) as exc:
                log.warning("slurm poll failed", error=str(exc))
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            except TimeoutError:
                continue
