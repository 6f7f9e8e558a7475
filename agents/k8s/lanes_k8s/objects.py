"""Reading Kubernetes objects as the API serves them (JSON), into the few facts the mapping needs.

Field names follow the API reference (core/v1 Pod, Node, Event), Kueue's `kueue.x-k8s.io` Workload and the
labels JobSet, the Kubeflow trainer and batch/v1 Job put on their pods. A malformed object raises
`K8sObjectError` naming the object and the field: the watch logs it and goes on with the next object.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
"""The index of an Indexed Job's pod, as annotation and (Kubernetes >= 1.28) label; JOB_COMPLETION_INDEX in it."""
JOB_NAME = "batch.kubernetes.io/job-name"
LEGACY_JOB_NAME = "job-name"
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
JOBSET_REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
JOBSET_REPLICAS = "jobset.sigs.k8s.io/replicatedjob-replicas"
JOBSET_JOB_INDEX = "jobset.sigs.k8s.io/job-index"
JOBSET_RESTART = "jobset.sigs.k8s.io/restart-attempt"
TRAINJOB_NAME = "trainer.kubeflow.org/trainjob-name"
TRAINING_JOB_NAME = "training.kubeflow.org/job-name"
TRAINING_REPLICA_TYPE = "training.kubeflow.org/replica-type"
TRAINING_REPLICA_INDEX = "training.kubeflow.org/replica-index"
DEFAULT_CONTAINER = "kubectl.kubernetes.io/default-container"


class K8sObjectError(ValueError):
    """An object the API served without a field the mapping needs, or with a value of the wrong shape."""


def parse_time(value: Any) -> datetime | None:
    """An RFC 3339 timestamp as the API writes it (`2026-12-07T20:10:09Z`), None when absent."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError as exc:
        raise K8sObjectError(f"not an RFC 3339 time: {value!r}") from exc


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> Sequence[Any]:
    return value if isinstance(value, list) else ()


def _int(value: Any, what: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise K8sObjectError(f"{what}: expected an integer, got {value!r}") from exc


@dataclass(frozen=True)
class Meta:
    """The metadata every object has: who it is, which version of it, and its labels."""

    kind: str
    uid: str
    namespace: str
    name: str
    resource_version: str
    created: datetime | None
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    controller: str | None
    """The name of the object that owns this one as its controller (a Workload's Job or JobSet)."""

    @property
    def ref(self) -> str:
        """`kind namespace/name`, for messages."""
        return f"{self.kind} {self.namespace}/{self.name}" if self.namespace else f"{self.kind} {self.name}"


def meta_of(obj: Mapping[str, Any], kind: str) -> Meta:
    """The metadata of an object; uid and name are required (every served object has them)."""
    meta = _mapping(obj.get("metadata"))
    uid, name = meta.get("uid"), meta.get("name")
    if not isinstance(uid, str) or not uid or not isinstance(name, str) or not name:
        raise K8sObjectError(f"{kind}: metadata.uid and metadata.name are required")
    controller = next(
        (str(ref.get("name")) for ref in _list(meta.get("ownerReferences")) if _mapping(ref).get("controller")),
        None,
    )
    return Meta(
        kind=kind,
        uid=uid,
        namespace=str(meta.get("namespace") or ""),
        name=name,
        resource_version=str(meta.get("resourceVersion") or ""),
        created=parse_time(meta.get("creationTimestamp")),
        labels={str(k): str(v) for k, v in _mapping(meta.get("labels")).items()},
        annotations={str(k): str(v) for k, v in _mapping(meta.get("annotations")).items()},
        controller=controller,
    )


@dataclass(frozen=True)
class Condition:
    """One `metav1.Condition` (Kueue) or node condition."""

    type: str
    status: str
    reason: str
    message: str
    at: datetime | None
    stamp: str
    """lastTransitionTime as served: with the type, the identity of one transition."""

    @property
    def true(self) -> bool:
        """Whether the condition holds."""
        return self.status == "True"


def conditions_of(status: Mapping[str, Any]) -> dict[str, Condition]:
    """The conditions of an object's status, by type."""
    found: dict[str, Condition] = {}
    for raw in _list(status.get("conditions")):
        cond = _mapping(raw)
        kind = cond.get("type")
        if not isinstance(kind, str):
            raise K8sObjectError("status.conditions[]: type is required")
        stamp = str(cond.get("lastTransitionTime") or "")
        found[kind] = Condition(
            type=kind,
            status=str(cond.get("status") or "Unknown"),
            reason=str(cond.get("reason") or ""),
            message=str(cond.get("message") or ""),
            at=parse_time(stamp),
            stamp=stamp,
        )
    return found


# --- Kueue Workload --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodSet:
    """One pod set of a Workload: a replicated job of a JobSet, a replica type of a PyTorchJob, a Job's pods."""

    name: str
    count: int


@dataclass(frozen=True)
class Workload:
    """What a Kueue Workload says: its pod sets, queue, conditions and admission."""

    meta: Meta
    queue: str
    pod_sets: tuple[PodSet, ...]
    active: bool
    conditions: Mapping[str, Condition]
    cluster_queue: str | None
    topology: tuple[str, str] | None
    """(level, domain) when Topology-Aware Scheduling put every pod set in one domain of its lowest level."""

    @property
    def owner(self) -> str:
        """The name of the job object the workload stands for (its controller), or its own name."""
        return self.meta.controller or self.meta.name

    @property
    def workers(self) -> int:
        """How many pods the workload runs: one rank each."""
        return sum(p.count for p in self.pod_sets)

    def offset_of(self, pod_set: str) -> int | None:
        """The first rank of a pod set: pod sets take consecutive ranks in the Workload's order."""
        first = 0
        for candidate in self.pod_sets:
            if candidate.name.lower() == pod_set.lower():
                return first
            first += candidate.count
        return None

    def count_of(self, pod_set: str) -> int | None:
        """How many pods a pod set has."""
        return next((p.count for p in self.pod_sets if p.name.lower() == pod_set.lower()), None)


def _topology(assignments: Sequence[Any]) -> tuple[str, str] | None:
    domains: set[tuple[str, str]] = set()
    for raw in assignments:
        assignment = _mapping(_mapping(raw).get("topologyAssignment"))
        levels = [str(level) for level in _list(assignment.get("levels"))]
        for domain in _list(assignment.get("domains")):
            values = [str(value) for value in _list(_mapping(domain).get("values"))]
            if levels and len(values) == len(levels):
                domains.add((levels[0], values[0]))
    return next(iter(domains)) if len(domains) == 1 else None


def workload_of(obj: Mapping[str, Any]) -> Workload:
    """A `kueue.x-k8s.io/v1beta1` (or v1beta2) Workload."""
    meta = meta_of(obj, "Workload")
    spec, status = _mapping(obj.get("spec")), _mapping(obj.get("status"))
    pod_sets = tuple(
        PodSet(name=str(_mapping(p).get("name") or "main"), count=_int(_mapping(p).get("count", 1), "podSets[].count"))
        for p in _list(spec.get("podSets"))
    )
    if not pod_sets:
        raise K8sObjectError(f"{meta.ref}: spec.podSets is empty")
    admission = _mapping(status.get("admission"))
    return Workload(
        meta=meta,
        queue=str(spec.get("queueName") or ""),
        pod_sets=pod_sets,
        active=spec.get("active") is not False,
        conditions=conditions_of(status),
        cluster_queue=str(admission["clusterQueue"]) if admission.get("clusterQueue") else None,
        topology=_topology(_list(admission.get("podSetAssignments"))),
    )


# --- Pods ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Termination:
    """How a container ended (`state.terminated` or `lastState.terminated`)."""

    container: str
    exit_code: int
    reason: str
    message: str
    at: datetime | None
    restarts: int
    """The container's restartCount when it was seen: with the pod's uid, the identity of this end."""
    raw: Mapping[str, Any]


@dataclass(frozen=True)
class Pod:
    """A pod as one rank of a job: whose it is, which rank, where it runs, and how its main container is."""

    meta: Meta
    owner: str | None
    """The name of the job object the pod belongs to (JobSet, TrainJob, PyTorchJob or Job)."""
    pod_set: str | None
    index: int | None
    """The pod's index inside its pod set (the rank before the pod set's offset)."""
    replicas: int
    """For a JobSet: how many Jobs its replicated job has (the index is job index * pods per job + pod index)."""
    job_index: int
    restart_attempt: int
    node: str | None
    started_at: datetime | None
    terminated: Termination | None
    restarted: tuple[Termination, ...]
    """Earlier ends of the main container (kubelet restarted it): lastState.terminated per restart seen."""


def _main_container(spec: Mapping[str, Any], meta: Meta) -> str | None:
    if DEFAULT_CONTAINER in meta.annotations:
        return meta.annotations[DEFAULT_CONTAINER]
    containers = _list(spec.get("containers"))
    return str(_mapping(containers[0]).get("name")) if containers else None


def _termination(raw: Any, container: str, restarts: int) -> Termination | None:
    terminated = _mapping(raw)
    if not terminated:
        return None
    return Termination(
        container=container,
        exit_code=_int(terminated.get("exitCode", 0), "terminated.exitCode"),
        reason=str(terminated.get("reason") or ""),
        message=str(terminated.get("message") or ""),
        at=parse_time(terminated.get("finishedAt")),
        restarts=restarts,
        raw=terminated,
    )


def _owner_and_index(meta: Meta) -> tuple[str | None, str | None, int | None]:
    labels, annotations = meta.labels, meta.annotations
    completion = annotations.get(COMPLETION_INDEX) or labels.get(COMPLETION_INDEX)
    index = _int(completion, COMPLETION_INDEX) if completion is not None else None
    if TRAINING_REPLICA_TYPE in labels:  # Kubeflow training operator (PyTorchJob): master, then workers
        replica = _int(labels.get(TRAINING_REPLICA_INDEX, 0), TRAINING_REPLICA_INDEX)
        return labels.get(TRAINING_JOB_NAME) or meta.controller, labels[TRAINING_REPLICA_TYPE], replica
    if JOBSET_NAME in labels:  # JobSet, and the Kubeflow trainer's TrainJob (a JobSet of the same name)
        jobset = labels.get(TRAINJOB_NAME) or labels[JOBSET_NAME]
        return jobset, labels.get(JOBSET_REPLICATED_JOB), index
    owner = labels.get(JOB_NAME) or labels.get(LEGACY_JOB_NAME) or meta.controller
    return owner, "main", index


def pod_of(obj: Mapping[str, Any]) -> Pod:
    """A core/v1 Pod."""
    meta = meta_of(obj, "Pod")
    spec, status = _mapping(obj.get("spec")), _mapping(obj.get("status"))
    owner, pod_set, index = _owner_and_index(meta)
    main = _main_container(spec, meta)
    state: Mapping[str, Any] = {}
    last: Mapping[str, Any] = {}
    restarts = 0
    for raw in _list(status.get("containerStatuses")):
        container = _mapping(raw)
        if container.get("name") == main:
            state, last = _mapping(container.get("state")), _mapping(container.get("lastState"))
            restarts = _int(container.get("restartCount", 0), "containerStatuses[].restartCount")
    running = _mapping(state.get("running"))
    terminated = _termination(state.get("terminated"), main or "", restarts)
    earlier = _termination(last.get("terminated"), main or "", restarts - 1) if restarts else None
    started = parse_time(running.get("startedAt")) or (
        parse_time(_mapping(state.get("terminated")).get("startedAt")) if terminated else None
    )
    return Pod(
        meta=meta,
        owner=owner,
        pod_set=pod_set,
        index=index,
        replicas=_int(meta.labels.get(JOBSET_REPLICAS, 1), JOBSET_REPLICAS),
        job_index=_int(meta.labels.get(JOBSET_JOB_INDEX, 0), JOBSET_JOB_INDEX),
        restart_attempt=_int(meta.labels.get(JOBSET_RESTART, 0), JOBSET_RESTART),
        node=str(spec["nodeName"]) if spec.get("nodeName") else None,
        started_at=started,
        terminated=terminated,
        restarted=(earlier,) if earlier else (),
    )


# --- Nodes and Events ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Taint:
    """A node taint."""

    key: str
    value: str
    effect: str


@dataclass(frozen=True)
class Node:
    """A core/v1 Node: its conditions, cordon and taints."""

    meta: Meta
    unschedulable: bool
    conditions: Mapping[str, Condition]
    taints: tuple[Taint, ...]


def node_of(obj: Mapping[str, Any]) -> Node:
    """A core/v1 Node."""
    meta = meta_of(obj, "Node")
    spec, status = _mapping(obj.get("spec")), _mapping(obj.get("status"))
    taints = tuple(
        Taint(key=str(t.get("key") or ""), value=str(t.get("value") or ""), effect=str(t.get("effect") or ""))
        for t in map(_mapping, _list(spec.get("taints")))
    )
    return Node(
        meta=meta, unschedulable=bool(spec.get("unschedulable")), conditions=conditions_of(status), taints=taints
    )


@dataclass(frozen=True)
class KubeEvent:
    """A core/v1 Event (or events.k8s.io/v1, whose fields it reads too)."""

    meta: Meta
    involved_kind: str
    involved_uid: str
    involved_name: str
    type: str
    reason: str
    message: str
    count: int
    at: datetime | None


def event_of(obj: Mapping[str, Any]) -> KubeEvent:
    """A core/v1 Event; `regarding`/`note`/`series` of events.k8s.io/v1 are read as well."""
    meta = meta_of(obj, "Event")
    involved = _mapping(obj.get("involvedObject") or obj.get("regarding"))
    series = _mapping(obj.get("series"))
    count = _int(series.get("count") or obj.get("count") or 1, "count")
    at = (
        parse_time(obj.get("lastTimestamp"))
        or parse_time(series.get("lastObservedTime"))
        or parse_time(obj.get("eventTime"))
        or parse_time(obj.get("firstTimestamp"))
        or meta.created
    )
    return KubeEvent(
        meta=meta,
        involved_kind=str(involved.get("kind") or ""),
        involved_uid=str(involved.get("uid") or ""),
        involved_name=str(involved.get("name") or ""),
        type=str(obj.get("type") or "Normal"),
        reason=str(obj.get("reason") or ""),
        message=str(obj.get("message") or obj.get("note") or ""),
        count=count,
        at=at,
    )


_NOT_TOKEN = re.compile(r"[^A-Za-z0-9_-]+")


def k8s_token(text: str, *, limit: int = 128) -> str:
    """A subject-safe token from a Kubernetes name (dots and slashes become dashes; names stay whole)."""
    cleaned = _NOT_TOKEN.sub("-", text).strip("-_")[:limit].rstrip("-_")
    return cleaned or "unnamed"
