"""Kubernetes objects onto the Lanes timeline: a pure fold from watch events to catalogue events.

- A Kueue Workload is a job (`submitted`, managed by Kueue). While it is not admitted, its QuotaReserved,
  Requeued or Evicted condition becomes a `waiting` event whose reason is Lanes' (capacity_short,
  spec_mismatch, topology_unsatisfiable, isolated) and whose detail and blocking resource keep Kueue's own
  reason and message.
- An admission opens an attempt; it is `placed` once every pod of the workload has a node (ranks from the
  pods' indices, level and domain from a Topology-Aware-Scheduling assignment). An eviction (PodsReadyTimeout,
  preemption with its Preempted reason, a stopped ClusterQueue) ends the attempt: its ranks stopped, its
  allocation released, platform evidence naming Kueue's reason, and a retry whose reason says the cause, so
  the next admission is attempt 2 of the same job. A JobSet restart (the pods' `restart-attempt` label, which
  the Kubeflow TrainJob's JobSet carries too) ends an attempt the same way. `Finished` ends the job.
- A pod is a rank: the index from `batch.kubernetes.io/job-completion-index` (JOB_COMPLETION_INDEX), JobSet's
  job index, or the training operator's replica type and index, offset by its pod set's place in the
  Workload. Its main container's start and end become `rank_started` / `rank_exited` (an exit code over 128
  is that signal, as container runtimes report it); `OOMKilled` is also host-lane evidence naming the rank,
  any other failed exit process evidence with the termination message.
- A node's conditions, cordon and taints become its state with the lane that owns it (Ready=False: host,
  NetworkUnavailable: network, a cordon or an eviction taint: platform).
- A Warning Event about a pod or a node is evidence on that node (and the pod's job and rank).

Ids. Every event id derives from the object's uid (a job id embeds its Workload's) and the version *of the
fact* inside the object: a condition's lastTransitionTime, a container's restartCount, an Event's count, a
node's change number. Not from the object's resourceVersion: that changes on every status write, so one fact
seen at two resourceVersions (once before a 410 Gone, once in the relist after it) would get two ids. The
fold also remembers what it published (`ObserverMemory`, saved with the resourceVersions), so a relist or a
restart publishes nothing twice even past JetStream's duplicate window.
"""

from __future__ import annotations

import hashlib
import json
import signal
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lanes_contract.events import (
    BlockingResource,
    CancelRequested,
    CommandData,
    Event,
    EvidenceCategory,
    EvidenceData,
    JobPlaced,
    JobPlacedData,
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
    utc_now,
)
from lanes_contract.ids import derived_event_id
from lanes_contract.topology import NodeState
from lanes_evidence.evidence import EVENT_OF_KIND, KIND_OF_CATEGORY, lane_of
from lanes_k8s.objects import (
    K8sObjectError,
    KubeEvent,
    Node,
    Pod,
    Termination,
    Workload,
    event_of,
    k8s_token,
    node_of,
    pod_of,
    workload_of,
)
from lanes_observe import observed

SOURCE = "lanes-k8s"
MANAGED_BY = "kueue"
Change = Literal["ADDED", "MODIFIED", "DELETED"]
KINDS = ("Workload", "Pod", "Node", "Event")
"""What the observer watches, in the order a relist reads them: a pod's workload before the pod."""


class _Memory(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RankSeen(_Memory):
    """One rank of the current attempt: its pod, its node, and what was published about it."""

    pod: str
    node: str | None = None
    started_at: datetime | None = None
    exit: RankExitedData | None = None
    exit_at: datetime | None = None
    started_sent: bool = False
    exit_sent: bool = False


class AttemptRecord(_Memory):
    """How an attempt ended, as the observer read it from Kubernetes."""

    number: int
    cause: Literal["evicted", "preempted", "restarted", "finished", "deleted"]
    reason: str = Field(description="Kubernetes' own reason: PodsReadyTimeout, InCohortFairSharing, Succeeded...")
    detail: str = ""
    placed: bool = False


class JobMemory(_Memory):
    """What the observer has published about one Workload's job."""

    job_id: str
    namespace: str
    owner: str
    workers: int
    pod_sets: tuple[tuple[str, int], ...]
    attempt: int = 1
    admitted: str | None = None
    """lastTransitionTime of the Admitted condition that opened the current attempt."""
    admitted_at: datetime | None = None
    running: bool = False
    """Whether the current attempt holds its admission (its pods are ranks); false between eviction and admission."""
    evicted: str | None = None
    """lastTransitionTime of the last eviction applied."""
    restart_attempt: int = 0
    topology: tuple[str, str] | None = None
    placement: tuple[RankAssignment, ...] = ()
    ranks: dict[int, RankSeen] = Field(default_factory=dict)
    ended: bool = False
    finished: bool = False
    wait: str | None = None
    waits: int = 0
    reported: tuple[str, ...] = ()
    """Keys of the evidence already published from this job's pods (container ends)."""
    attempts: tuple[AttemptRecord, ...] = ()


class NodeMemory(_Memory):
    """A node's last published state."""

    state: NodeState
    reason: str
    changes: int


class ObserverMemory(_Memory):
    """Everything the fold remembers; saved beside the resourceVersions so a restart resumes where it was."""

    jobs: dict[str, JobMemory] = Field(default_factory=dict)
    """By Workload uid."""
    owners: dict[str, str] = Field(default_factory=dict)
    """`namespace/owner name` -> the uid of the Workload that stands for it now."""
    waiting_pods: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Pods seen before their Workload (raw objects by pod uid), applied once it comes."""
    pods: dict[str, tuple[str, int, int | None, str | None]] = Field(default_factory=dict)
    """Pod uid -> (workload uid, attempt, rank, node), so an Event about a pod finds its job."""
    nodes: dict[str, NodeMemory] = Field(default_factory=dict)
    kube_events: dict[str, int] = Field(default_factory=dict)
    """Event uid -> the count already published (an Event repeats by counting up)."""


# --- ids -------------------------------------------------------------------------------------------


def job_id_of(workload: Workload) -> str:
    """`k8s-<namespace>-<owner>-<uid prefix>`: readable, and a re-created job of the same name is another job."""
    stem = k8s_token(f"k8s-{workload.meta.namespace}-{workload.owner}", limit=119)
    return f"{stem}-{hashlib.sha256(workload.meta.uid.encode()).hexdigest()[:8]}"


def _type_of(cls: type[Event]) -> str:
    return str(cls.model_fields["type"].default)


# --- wait reasons ----------------------------------------------------------------------------------

_SPEC_WORDS = ("doesn't match", "does not match", "untolerated taint", "exceeds", "maximum capacity", "no flavor")
_TOPOLOGY_WORDS = ("topology", "domain")
_ISOLATED_REASONS = frozenset({"ClusterQueueStopped", "LocalQueueStopped", "Inactive", "Deactivated", "OnHold"})
_ISOLATED_WORDS = ("is inactive", "doesn't exist", "does not exist", "is stopped", "stopped", "on hold")


def wait_reason(kueue_reason: str, message: str) -> tuple[str, Lane, Literal["quota", "pool", "capacity", "domain"]]:
    """Kueue's pending reason and message as a Lanes wait reason, the lane that can unblock it and what blocks.

    Kueue says why in its message ("couldn't assign flavors to pod set main: insufficient unused quota for
    nvidia.com/gpu in flavor h100, 4 more needed"); its reason is often just `Pending`.
    """
    text = message.lower()
    if kueue_reason in _ISOLATED_REASONS or any(word in text for word in _ISOLATED_WORDS):
        return "isolated", Lane.PLATFORM, "pool"
    if any(word in text for word in _TOPOLOGY_WORDS):
        return "topology_unsatisfiable", Lane.PLATFORM, "domain"
    if any(word in text for word in _SPEC_WORDS) or "request > maximum" in text:
        return "spec_mismatch", Lane.ALGORITHM, "pool"
    if "quota" in text:
        return "capacity_short", Lane.PLATFORM, "quota"
    return "capacity_short", Lane.PLATFORM, "capacity"


_HELD: tuple[str, Lane, Literal["quota", "pool", "capacity", "domain"]] = ("isolated", Lane.PLATFORM, "pool")


def _pending(workload: Workload) -> tuple[str, str, bool] | None:
    """(Kueue reason, message, held back by Kueue itself) for an unadmitted workload; None when nothing says.

    A workload deactivated, or in its requeue backoff after an eviction, is isolated by Kueue's policy whatever
    its message says; otherwise the message tells capacity, spec and topology apart.
    """
    conds = workload.conditions
    if not workload.active:
        deactivated = conds.get("Requeued") or conds.get("Evicted")
        return ("Inactive", deactivated.message if deactivated else "spec.active is false", True)
    requeued = conds.get("Requeued")
    if requeued is not None and not requeued.true:  # the backoff after an eviction
        return (requeued.reason or "Requeued", requeued.message or "waiting for the requeue backoff", True)
    reserved = conds.get("QuotaReserved")
    if reserved is not None and not reserved.true:
        return (reserved.reason or "Pending", reserved.message, False)
    return None


# --- exits -----------------------------------------------------------------------------------------

_SIGNAL_BASE = 128
_MAX_SIGNAL = 64
_STOPPED = observed.STOPPED


def exit_of(end: Termination) -> RankExitedData:
    """A container's end as a rank's exit: OOMKilled is SIGKILL, a code over 128 the signal it encodes."""
    if end.reason == "OOMKilled":
        return RankExitedData(exit_code=None, signal=signal.SIGKILL)
    if _SIGNAL_BASE < end.exit_code <= _SIGNAL_BASE + _MAX_SIGNAL:
        return RankExitedData(exit_code=None, signal=end.exit_code - _SIGNAL_BASE)
    return RankExitedData(exit_code=end.exit_code)


def _evidence(
    data: EvidenceData,
    *,
    uid: str,
    key: str,
    node: str,
    time: datetime | None,
    job_id: str | None = None,
    attempt: int | None = None,
    rank: int | None = None,
) -> Event:
    cls = EVENT_OF_KIND[KIND_OF_CATEGORY[data.category]]
    return cls(
        id=derived_event_id(uid, _type_of(cls), key, at=time),
        source=SOURCE,
        node=k8s_token(node),
        jobid=job_id,
        attempt=attempt,
        rank=rank,
        time=time or utc_now(),
        lane=lane_of(data),
        data=data,
    )


def _termination_evidence(pod: Pod, end: Termination, rank: int, job: JobMemory) -> Event | None:
    """OOMKilled: host-lane evidence naming the rank. Another failed end: process evidence with its message."""
    if end.exit_code == 0 and end.reason != "OOMKilled":
        return None
    where = f"rank {rank}: container {end.container} of pod {pod.meta.namespace}/{pod.meta.name}"
    line = json.dumps(dict(end.raw), separators=(",", ":"), sort_keys=True, default=str)
    exit_data = exit_of(end)
    if end.reason == "OOMKilled":
        data = EvidenceData(
            category=EvidenceCategory.OOM_KILL,
            summary=f"{where} was OOMKilled (exit {end.exit_code})"[:1024],
            lines=(line,),
            origin=f"k8s pod {pod.meta.namespace}/{pod.meta.name}"[:256],
            exit_code=end.exit_code,
            signal=signal.SIGKILL,
        )
    else:
        message = f": {end.message.strip()}" if end.message.strip() else ""
        data = EvidenceData(
            category=EvidenceCategory.PROCESS_EXITED,
            summary=f"{where} ended {end.reason or 'with an error'} (exit {end.exit_code}){message}"[:1024],
            lines=(line, *end.message.strip().splitlines()[-20:]),
            origin=f"k8s pod {pod.meta.namespace}/{pod.meta.name}"[:256],
            exit_code=exit_data.exit_code,
            signal=exit_data.signal,
        )
    return _evidence(
        data,
        uid=pod.meta.uid,
        key=f"{end.container}/{end.restarts}",
        node=pod.node or "unscheduled",
        time=end.at,
        job_id=job.job_id,
        attempt=job.attempt,
        rank=rank,
    )


# --- workloads -------------------------------------------------------------------------------------


def _event(cls: type[Any], job: JobMemory, *, key: str = "", time: datetime | None = None, **fields: Any) -> Any:
    return observed.observed_event(
        cls, job_id=job.job_id, attempt=job.attempt, source=SOURCE, key=key, time=time, **fields
    )


def _publish_ranks(job: JobMemory) -> tuple[JobMemory, list[Event]]:
    """Starts and exits of placed ranks not published yet (a pod may have run before the last pod landed)."""
    if not job.placement:
        return job, []
    events: list[Event] = []
    ranks = dict(job.ranks)
    for assignment in job.placement:
        seen = ranks.get(assignment.rank)
        if seen is None:
            continue
        if not seen.started_sent and seen.started_at is not None:
            events.append(
                observed.rank_started(
                    job.job_id, job.attempt, assignment.rank, assignment.node, source=SOURCE, time=seen.started_at
                )
            )
            seen = seen.model_copy(update={"started_sent": True})
        if not seen.exit_sent and seen.exit is not None:
            events.append(
                observed.rank_exited(
                    job.job_id,
                    job.attempt,
                    assignment.rank,
                    assignment.node,
                    seen.exit,
                    source=SOURCE,
                    time=seen.exit_at,
                )
            )
            seen = seen.model_copy(update={"exit_sent": True})
        ranks[assignment.rank] = seen
    return job.model_copy(update={"ranks": ranks}), events


def _try_place(job: JobMemory) -> tuple[JobMemory, list[Event]]:
    """Place the attempt once every rank has a node; then publish what its ranks did meanwhile."""
    if job.placement or job.ended or job.admitted is None:
        return _publish_ranks(job)
    on_nodes = {rank: seen.node for rank, seen in job.ranks.items() if seen.node is not None}
    if len(on_nodes) < job.workers:
        return job, []
    assignments = tuple(
        RankAssignment(rank=rank, node=k8s_token(node), gpus=()) for rank, node in sorted(on_nodes.items())
    )
    level, domain = job.topology or (None, None)
    data = JobPlacedData(assignments=assignments, level=level, domain=domain)
    placed = _event(JobPlaced, job, time=job.admitted_at, data=data)
    job, events = _publish_ranks(job.model_copy(update={"placement": assignments}))
    return job, [placed, *events]


def _end_attempt(
    job: JobMemory,
    cause: Literal["evicted", "preempted", "restarted", "finished", "deleted"],
    reason: str,
    detail: str,
    at: datetime | None,
    *,
    succeeded: bool = False,
) -> tuple[JobMemory, list[Event]]:
    """End the current attempt: exits for ranks still running, the release, and what comes next."""
    events: list[Event] = []
    record = AttemptRecord(number=job.attempt, cause=cause, reason=reason, detail=detail, placed=bool(job.placement))
    said = f"{reason}: {detail}" if detail else reason
    if cause == "deleted":
        cancel = CommandData(reason="deleted in Kubernetes", requested_by=MANAGED_BY)
        events.append(_event(CancelRequested, job, time=at, data=cancel))
    if job.placement:
        ranks = dict(job.ranks)
        stop = RankExitedData(exit_code=0) if succeeded else _STOPPED
        unstarted = RankExitedData(exit_code=None, start_error=f"its pod never started: {cause} ({said})"[:1024])
        for assignment in job.placement:
            seen = ranks.get(assignment.rank) or RankSeen(pod="", node=assignment.node)
            if seen.exit is None:
                ended = stop if seen.started_at is not None else unstarted
                ranks[assignment.rank] = seen.model_copy(update={"exit": ended, "exit_at": at})
        job, events_ranks = _publish_ranks(job.model_copy(update={"ranks": ranks}))
        events.extend(events_ranks)
        if cause in {"evicted", "preempted"}:
            kueue = EvidenceData(
                category=EvidenceCategory.PREEMPTION,
                summary=f"Kueue {cause} workload {job.namespace}/{job.owner} (attempt {job.attempt}): {said}"[:1024],
                origin=f"k8s workload {job.namespace}/{job.owner}"[:256],
            )
            first = job.placement[0]
            events.append(
                _evidence(
                    kueue,
                    uid=job.job_id,
                    key=f"{job.attempt}/{cause}",
                    node=first.node,
                    time=at,
                    job_id=job.job_id,
                    attempt=job.attempt,
                )
            )
        events.append(
            observed.released(job.job_id, job.attempt, [a.node for a in job.placement], source=SOURCE, time=at)
        )
    elif cause == "finished" and not succeeded:
        never = JobRejectedData(reason=f"kueue_{reason.lower() or 'failed'}", detail=f"Kueue: {said}"[:1024])
        events.append(_event(JobRejected, job, time=at, data=never))
    job = job.model_copy(update={"ended": True, "running": cause == "restarted", "attempts": (*job.attempts, record)})
    if cause in {"evicted", "preempted", "restarted"}:
        if record.placed:
            retry = RetryData(reason=f"{cause} by Kubernetes ({said})"[:1024], requested_by=MANAGED_BY)
            events.append(_event(RetryRequested, job, time=at, data=retry))
            job = job.model_copy(update={"attempt": job.attempt + 1})
        # never placed: Lanes saw no attempt run, so the job simply waits on (the record keeps the cause)
        job = job.model_copy(update={"placement": (), "ranks": {}, "ended": False, "wait": None})
    return job, events


def observe_workload(job: JobMemory | None, workload: Workload, change: Change) -> tuple[JobMemory, list[Event]]:
    """What changed in a Workload since `job`, as events; pure."""
    events: list[Event] = []
    if job is None:
        job = JobMemory(
            job_id=job_id_of(workload),
            namespace=workload.meta.namespace,
            owner=workload.owner,
            workers=workload.workers,
            pod_sets=tuple((p.name, p.count) for p in workload.pod_sets),
        )
        spec = observed.observed_spec(
            workload.owner,
            workers=workload.workers,
            managed_by=MANAGED_BY,
            tenant=workload.meta.namespace or "default",
            pool=workload.queue or "default",
        )
        events.append(observed.submitted(job.job_id, spec, source=SOURCE, time=workload.meta.created))
    if job.finished:
        return job, events
    conds = workload.conditions
    evicted, admitted, finished = conds.get("Evicted"), conds.get("Admitted"), conds.get("Finished")
    if (
        evicted is not None
        and evicted.true
        and job.admitted is not None
        and not job.ended
        and evicted.stamp != job.evicted
        and (evicted.at is None or job.admitted_at is None or evicted.at >= job.admitted_at)
    ):
        preempted = conds.get("Preempted")
        if evicted.reason == "Preempted" and preempted is not None and preempted.true:
            cause: Literal["evicted", "preempted"] = "preempted"
            reason, detail = preempted.reason, preempted.message
        else:
            cause, reason, detail = "evicted", evicted.reason, evicted.message
        job, ended = _end_attempt(job, cause, reason, detail, evicted.at)
        job = job.model_copy(update={"evicted": evicted.stamp})
        events.extend(ended)
    if admitted is not None and admitted.true and admitted.stamp != job.admitted and not (finished and finished.true):
        if job.admitted is not None and job.placement and not job.ended:
            # Re-admitted without the eviction in between being seen (compacted away): the attempt still ended.
            job, ended = _end_attempt(job, "evicted", "Unknown", "re-admitted; the eviction was not observed", None)
            events.extend(ended)
        job = job.model_copy(
            update={
                "admitted": admitted.stamp,
                "admitted_at": admitted.at,
                "running": True,
                "topology": workload.topology,
                "ended": False,
                "wait": None,
            }
        )
        job, placed = _try_place(job)
        events.extend(placed)
    if finished is not None and finished.true:
        succeeded = finished.reason == "Succeeded"
        job, ended = _end_attempt(job, "finished", finished.reason, finished.message, finished.at, succeeded=succeeded)
        return job.model_copy(update={"finished": True}), [*events, *ended]
    if change == "DELETED":
        job, ended = _end_attempt(job, "deleted", "Deleted", "the Workload was deleted", utc_now())
        return job.model_copy(update={"finished": True}), [*events, *ended]
    is_admitted = admitted is not None and admitted.true
    pending = None if is_admitted else _pending(workload)
    if pending is not None:
        kueue_reason, message, held = pending
        said = f"{kueue_reason}: {message}" if message else kueue_reason
        if said != job.wait:
            reason, lane, kind = _HELD if held else wait_reason(kueue_reason, message)
            queue = workload.cluster_queue or workload.queue or "default"
            blocking = BlockingResource(kind=kind, id=queue, reason=said[:512], owner_lane=lane)
            data = JobWaitingData(reason=reason, detail=f"Kueue: {said}"[:1024], owner_lane=lane, blocking=(blocking,))
            events.append(_event(JobWaiting, job, key=f"{job.waits}:{said}", data=data))
            job = job.model_copy(update={"wait": said, "waits": job.waits + 1})
    return job, events


# --- pods ------------------------------------------------------------------------------------------


def rank_of(pod: Pod, job: JobMemory) -> int:
    """The pod's rank in its job: its pod set's first rank plus its index there."""
    sets = {name.lower(): count for name, count in job.pod_sets}
    offset = 0
    for name, count in job.pod_sets:
        if pod.pod_set is not None and name.lower() == pod.pod_set.lower():
            break
        offset += count
    else:
        if len(job.pod_sets) != 1:
            raise K8sObjectError(f"{pod.meta.ref}: pod set {pod.pod_set!r} is not one of the Workload's")
        offset = 0
    count = sets.get((pod.pod_set or "").lower(), job.pod_sets[0][1] if len(job.pod_sets) == 1 else 1)
    if pod.index is None:
        if count == 1 and pod.replicas == 1:
            return offset
        raise K8sObjectError(f"{pod.meta.ref}: no completion index or replica index to tell its rank")
    per_job = max(count // max(pod.replicas, 1), 1)
    return offset + pod.job_index * per_job + pod.index


def observe_pod(job: JobMemory, pod: Pod, change: Change) -> tuple[JobMemory, list[Event]]:  # noqa: PLR0912 - one branch per thing a pod can say, in order
    """What a pod of the job says about its rank, as events; pure."""
    events: list[Event] = []
    if not job.running:
        return job, events  # not admitted (yet, or any more): its pods are not ranks of an attempt
    if job.admitted_at is not None and pod.meta.created is not None and pod.meta.created < job.admitted_at:
        return job, events  # a pod of an earlier attempt, ending after the eviction that ended its attempt
    if pod.restart_attempt < job.restart_attempt:
        return job, events  # JobSet replaced it already
    if pod.restart_attempt > job.restart_attempt:
        job, ended = _end_attempt(job, "restarted", "JobSetRestart", f"restart attempt {pod.restart_attempt}", None)
        events.extend(ended)
        job = job.model_copy(update={"restart_attempt": pod.restart_attempt})
    rank = rank_of(pod, job)
    seen = job.ranks.get(rank)
    if seen is None or seen.pod != pod.meta.uid:
        if seen is not None and seen.exit is None and seen.pod:
            return job, events  # another pod already holds this rank in this attempt
        seen = RankSeen(pod=pod.meta.uid)
    update: dict[str, Any] = {}
    if pod.node and seen.node is None:
        update["node"] = pod.node
    if pod.started_at and seen.started_at is None:
        update["started_at"] = pod.started_at
    reported = list(job.reported)
    for end in (*pod.restarted, *((pod.terminated,) if pod.terminated else ())):
        key = f"{pod.meta.uid}/{end.container}/{end.restarts}"
        if key in reported:
            continue
        found = _termination_evidence(pod, end, rank, job)
        if found is not None:
            events.append(found)
        reported.append(key)
    if pod.terminated is not None and seen.exit is None:
        update |= {"exit": exit_of(pod.terminated), "exit_at": pod.terminated.at}
    elif change == "DELETED" and seen.exit is None and (seen.started_at or update.get("started_at")):
        update |= {"exit": _STOPPED, "exit_at": utc_now()}
    seen = seen.model_copy(update=update)
    job = job.model_copy(update={"ranks": job.ranks | {rank: seen}, "reported": tuple(reported)})
    job, placed = _try_place(job)
    return job, [*events, *placed]


# --- nodes -----------------------------------------------------------------------------------------

_PRESSURE = ("MemoryPressure", "DiskPressure", "PIDPressure")
_UNREACHABLE_TAINTS = frozenset({"node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"})


def node_state(node: Node) -> tuple[NodeState, Lane, str]:
    """A node's state, the lane that owns it, and why, from its conditions, cordon and taints."""
    ready = node.conditions.get("Ready")
    if ready is not None and not ready.true:
        return NodeState.UNHEALTHY, Lane.HOST, f"Ready={ready.status}: {ready.reason} {ready.message}".strip()
    network = node.conditions.get("NetworkUnavailable")
    if network is not None and network.true:
        return NodeState.UNHEALTHY, Lane.NETWORK, f"NetworkUnavailable: {network.reason} {network.message}".strip()
    unreachable = [t for t in node.taints if t.key in _UNREACHABLE_TAINTS]
    if unreachable:
        return NodeState.UNHEALTHY, Lane.HOST, f"taint {unreachable[0].key}:{unreachable[0].effect}"
    pressure = [c for name in _PRESSURE if (c := node.conditions.get(name)) is not None and c.true]
    if pressure:
        return NodeState.DRAINING, Lane.HOST, f"{pressure[0].type}: {pressure[0].reason} {pressure[0].message}".strip()
    evicting = [t for t in node.taints if t.effect == "NoExecute"]
    if evicting:
        taint = evicting[0]
        return NodeState.DRAINING, Lane.PLATFORM, f"taint {taint.key}={taint.value}:NoExecute"
    if node.unschedulable:
        return NodeState.CORDONED, Lane.PLATFORM, "cordoned (spec.unschedulable)"
    return NodeState.READY, Lane.HOST, ""


def observe_node(known: NodeMemory | None, node: Node) -> tuple[NodeMemory, list[Event]]:
    """A node event when its state or reason changed; pure."""
    state, lane, reason = node_state(node)
    if known is not None and (known.state, known.reason) == (state, reason):
        return known, []
    changes = known.changes + 1 if known else 1
    if known is None and state is NodeState.READY:
        return NodeMemory(state=state, reason=reason, changes=changes), []  # nothing to say about a healthy node
    event = NodeStateChanged(
        id=derived_event_id(node.meta.uid, _type_of(NodeStateChanged), f"{changes}:{state}:{reason}"),
        source=SOURCE,
        node=k8s_token(node.meta.name),
        lane=lane,
        data=NodeStateChangedData(state=state, reason=f"Kubernetes: {reason}"[:1024] if reason else ""),
    )
    return NodeMemory(state=state, reason=reason, changes=changes), [event]


# --- Events ----------------------------------------------------------------------------------------

_EVENT_CATEGORIES: Mapping[str, EvidenceCategory] = {
    "OOMKilling": EvidenceCategory.OOM_KILL,
    "SystemOOM": EvidenceCategory.OOM_KILL,
    "NodeNotReady": EvidenceCategory.NODE_LOST,
    "Rebooted": EvidenceCategory.NODE_LOST,
    "Preempted": EvidenceCategory.PREEMPTION,
    "Preempting": EvidenceCategory.PREEMPTION,
    "Evicted": EvidenceCategory.PREEMPTION,
    "TaintManagerEviction": EvidenceCategory.PREEMPTION,
    "FailedMount": EvidenceCategory.RESOURCE_EXHAUSTED,
    "FailedAttachVolume": EvidenceCategory.RESOURCE_EXHAUSTED,
    "FailedCreatePodSandBox": EvidenceCategory.RESOURCE_EXHAUSTED,
    "ErrImagePull": EvidenceCategory.CONFIG_MISMATCH,
    "ImagePullBackOff": EvidenceCategory.CONFIG_MISMATCH,
    "InspectFailed": EvidenceCategory.CONFIG_MISMATCH,
}
"""Event reasons of the kubelet, node controller and node-problem-detector that say what happened."""
_NOTEWORTHY_NORMAL = frozenset({"Preempted", "Evicted", "Killing"})


def event_evidence(event: KubeEvent, *, node: str | None, job: tuple[str, int, int | None] | None) -> Event | None:
    """A Warning Event (or a preemption) about a pod on a node, or about a node, as evidence; pure.

    `job` is (job id, attempt, rank) for an Event about a pod of a known job.
    """
    if event.type != "Warning" and event.reason not in _NOTEWORTHY_NORMAL:
        return None
    if node is None:
        return None
    category = _EVENT_CATEGORIES.get(event.reason, EvidenceCategory.RAW)
    if event.reason in {"Failed", "BackOff"} and "image" in event.message.lower():
        category = EvidenceCategory.CONFIG_MISMATCH  # the kubelet's image pull failure (or its back-off)
    line = f"{event.type} {event.reason} {event.involved_kind}/{event.involved_name}: {event.message}"
    data = EvidenceData(
        category=category,
        summary=line[:1024],
        lines=(line,),
        origin=f"k8s event {event.meta.namespace}/{event.meta.name}"[:256],
    )
    job_id, attempt, rank = job if job is not None else (None, None, None)
    return _evidence(
        data,
        uid=event.meta.uid,
        key=str(event.count),
        node=node,
        time=event.at,
        job_id=job_id,
        attempt=attempt,
        rank=rank,
    )


# --- the fold over all kinds -----------------------------------------------------------------------


class Observer:
    """The fold over every watched kind: `apply` one watch event, get the catalogue events it means.

    No I/O: the watch feeds it, the outbox publishes what it returns, and `memory` is saved with the
    resourceVersions so a restart picks up where it was.
    """

    def __init__(self, memory: ObserverMemory | None = None) -> None:
        self.memory = memory or ObserverMemory()

    def apply(self, kind: str, change: Change, obj: Mapping[str, Any]) -> list[Event]:
        """One watch event (ADDED / MODIFIED / DELETED) of one object; raises K8sObjectError on a bad object."""
        if kind == "Workload":
            return self._workload(workload_of(obj), change)
        if kind == "Pod":
            return self._pod(obj, change)
        if kind == "Node":
            node = node_of(obj)
            if change == "DELETED":
                self.memory.nodes.pop(node.meta.uid, None)
                return []
            known, events = observe_node(self.memory.nodes.get(node.meta.uid), node)
            self.memory.nodes[node.meta.uid] = known
            return events
        if kind == "Event":
            return self._kube_event(event_of(obj), change)
        raise K8sObjectError(f"the observer does not watch {kind}")

    def _workload(self, workload: Workload, change: Change) -> list[Event]:
        memory = self.memory
        uid = workload.meta.uid
        known = memory.jobs.get(uid)
        if known is None and change == "DELETED":
            return []  # a workload deleted before it was ever seen: nothing ran that Lanes knows of
        job, events = observe_workload(known, workload, change)
        memory.jobs[uid] = job
        owner = f"{job.namespace}/{job.owner}"
        memory.owners[owner] = uid
        if job.running:
            for raw in memory.waiting_pods.pop(owner, {}).values():
                events.extend(self._pod(raw, "ADDED"))
        elif job.finished:
            memory.waiting_pods.pop(owner, None)
        if change == "DELETED":
            memory.jobs.pop(uid, None)
            memory.owners.pop(owner, None)
            for pod in [p for p, (w, *_) in memory.pods.items() if w == uid]:
                memory.pods.pop(pod, None)
        return events

    def _pod(self, raw: Mapping[str, Any], change: Change) -> list[Event]:
        pod = pod_of(raw)
        if pod.owner is None:
            return []  # a pod of no job (a Deployment's, a bare pod): not a rank of anything Lanes follows
        owner = f"{pod.meta.namespace}/{pod.owner}"
        uid = self.memory.owners.get(owner)
        known = self.memory.jobs.get(uid) if uid is not None else None
        if known is None or (not known.running and not known.finished):
            # Its Workload not seen yet, or not admitted yet as far as its own watch has said: each kind has
            # its own watch, so a pod can come first. Kept until the Workload is admitted, then applied.
            waiting = self.memory.waiting_pods.setdefault(owner, {})
            if change == "DELETED":
                waiting.pop(pod.meta.uid, None)
            else:
                waiting[pod.meta.uid] = dict(raw)
            if not waiting:
                self.memory.waiting_pods.pop(owner, None)
            return []
        assert uid is not None  # noqa: S101 - known is not None
        job, events = observe_pod(self.memory.jobs[uid], pod, change)
        self.memory.jobs[uid] = job
        ranks = [rank for rank, seen in job.ranks.items() if seen.pod == pod.meta.uid]
        if change == "DELETED":
            self.memory.pods.pop(pod.meta.uid, None)
        elif ranks:
            self.memory.pods[pod.meta.uid] = (uid, job.attempt, ranks[0], pod.node)
        return events

    def _kube_event(self, event: KubeEvent, change: Change) -> list[Event]:
        if change == "DELETED":
            self.memory.kube_events.pop(event.meta.uid, None)
            return []
        if self.memory.kube_events.get(event.meta.uid, 0) >= event.count:
            return []
        node: str | None = None
        job: tuple[str, int, int | None] | None = None
        if event.involved_kind == "Node":
            node = event.involved_name
        elif event.involved_kind == "Pod" and event.involved_uid in self.memory.pods:
            workload, attempt, rank, node = self.memory.pods[event.involved_uid]
            known = self.memory.jobs.get(workload)
            job = (known.job_id, attempt, rank) if known is not None else None
        found = event_evidence(event, node=node, job=job)
        self.memory.kube_events[event.meta.uid] = event.count
        return [found] if found is not None else []
