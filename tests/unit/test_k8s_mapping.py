"""The Kubernetes mapping, on watch events written in the API's own JSON (tests/data/k8s/*.ndjson).

The streams follow the API reference (core/v1 Pod, Node, Event), Kueue's Workload (v1beta1: conditions
QuotaReserved, Admitted, PodsReady, Evicted with reason PodsReadyTimeout, Requeued, Finished; admission with
a topologyAssignment) and the labels JobSet and batch/v1 Indexed Jobs put on their pods.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from lanes_contract.codec import decode, encode
from lanes_contract.events import (
    Event,
    EvidenceCategory,
    HostEvidence,
    JobPlaced,
    JobSubmitted,
    JobWaiting,
    Lane,
    NodeStateChanged,
    PlatformEvidence,
    RankExited,
    RankStarted,
    ResourcesReleased,
    RetryRequested,
)
from lanes_contract.jobs import FailureCause, JobState
from lanes_contract.topology import NodeState
from lanes_evidence.evidence import from_event
from lanes_k8s.mapping import Observer, ObserverMemory, rank_of, wait_reason
from lanes_k8s.objects import K8sObjectError, pod_of
from lanes_lifecycle.domain.job import JobView, evolve
from lanes_telemetry.domain.election import World, elect_first_error

DATA = Path(__file__).resolve().parents[1] / "data" / "k8s"


def stream(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


def replay(observer: Observer, watch_events: list[dict[str, Any]]) -> list[Event]:
    events: list[Event] = []
    for item in watch_events:
        events.extend(observer.apply(item["object"]["kind"], item["type"], item["object"]))
    return events


def fold(events: list[Event]) -> JobView:
    view: JobView | None = None
    for event in events:
        if event.family == "job":
            view, _ = evolve(view, event)
    assert view is not None
    return view


def test_a_workload_evicted_for_pods_ready_timeout_is_one_job_with_two_attempts_each_with_its_cause():
    observer = Observer()
    events = replay(observer, stream("kueue-podsreadytimeout.ndjson"))

    assert len({e.id for e in events}) == len(events)
    assert len([e for e in events if isinstance(e, JobSubmitted)]) == 1
    job_ids = {e.jobid for e in events if e.family == "job"}
    assert len(job_ids) == 1
    (job_id,) = job_ids
    assert job_id is not None
    assert job_id.startswith("k8s-team-a-train-")

    placed = [e for e in events if isinstance(e, JobPlaced)]
    assert [(p.attempt, p.data.nodes) for p in placed] == [
        (1, ("gpu-node-1", "gpu-node-2")),
        (2, ("gpu-node-3", "gpu-node-4")),
    ]
    assert (placed[0].data.level, placed[0].data.domain) == ("cloud.provider.com/topology-block", "block-1")
    (retry,) = [e for e in events if isinstance(e, RetryRequested)]
    assert retry.attempt == 1
    assert "evicted" in retry.data.reason
    assert "PodsReadyTimeout" in retry.data.reason
    (kueue,) = [e for e in events if isinstance(e, PlatformEvidence) and e.data.category is EvidenceCategory.PREEMPTION]
    assert "PodsReadyTimeout" in kueue.data.summary
    assert kueue.attempt == 1

    waits = [
        (e.attempt, e.data.reason, e.data.detail.split(":")[1].strip()) for e in events if isinstance(e, JobWaiting)
    ]
    assert waits == [
        (1, "capacity_short", "Pending"),
        (2, "isolated", "PodsReadyTimeout"),
        (2, "capacity_short", "Pending"),
    ]
    waiting = next(e for e in events if isinstance(e, JobWaiting))
    assert waiting.data.blocking[0].kind == "quota"
    assert "insufficient unused quota" in waiting.data.detail  # Kueue's own words kept beside Lanes' reason

    # The never-started rank of attempt 1 says why; the running one was stopped.
    first_exits = {e.rank: e.data for e in events if isinstance(e, RankExited) and e.attempt == 1}
    assert first_exits[0].signal == signal.SIGTERM
    assert first_exits[1].start_error is not None
    assert "PodsReadyTimeout" in first_exits[1].start_error
    assert {e.rank for e in events if isinstance(e, RankStarted) and e.attempt == 1} == {0}
    assert [e.attempt for e in events if isinstance(e, ResourcesReleased)] == [1, 2]

    # The observer's own account of the attempts ...
    (job,) = observer.memory.jobs.values()
    assert [(a.number, a.cause, a.reason) for a in job.attempts] == [
        (1, "evicted", "PodsReadyTimeout"),
        (2, "finished", "Succeeded"),
    ]
    # ... and the lifecycle's fold over the published events: one job, two attempts, each with its cause.
    view = fold(events)
    assert view.state is JobState.RELEASED
    assert [(a.number, a.cause, a.released) for a in view.attempts] == [
        (1, FailureCause.PLATFORM_ACTION, True),
        (2, FailureCause.NORMAL_COMPLETION, True),
    ]
    assert [a.placement[0].node for a in view.attempts] == ["gpu-node-1", "gpu-node-3"]


def test_an_image_pull_warning_is_evidence_on_the_pods_rank_and_node():
    events = replay(Observer(), stream("kueue-podsreadytimeout.ndjson"))
    (pull,) = [e for e in events if e.family == "tel" and e.data.category is EvidenceCategory.CONFIG_MISMATCH]
    assert (pull.node, pull.rank, pull.attempt, pull.lane) == ("gpu-node-2", 1, 1, Lane.PLATFORM)
    assert "Failed to pull image" in pull.data.lines[0]


def test_an_oomkilled_pod_is_host_lane_evidence_naming_its_rank_and_the_elected_first_error():
    events = replay(Observer(), stream("jobset-oomkilled.ndjson"))
    placed = next(e for e in events if isinstance(e, JobPlaced))
    # JobSet: rank = job index x pods per job + completion index
    assert [(a.rank, a.node) for a in placed.data.assignments] == [
        (0, "gpu-node-1"),
        (1, "gpu-node-2"),
        (2, "gpu-node-3"),
        (3, "gpu-node-4"),
    ]
    (oom,) = [e for e in events if isinstance(e, HostEvidence)]
    assert oom.data.category is EvidenceCategory.OOM_KILL
    assert (oom.lane, oom.rank, oom.node, oom.attempt) == (Lane.HOST, 3, "gpu-node-4", 1)
    assert "rank 3" in oom.data.summary
    assert "OOMKilled" in oom.data.summary
    exits = {e.rank: e.data for e in events if isinstance(e, RankExited)}
    assert exits[3].signal == signal.SIGKILL
    assert exits[0].signal == signal.SIGTERM  # exit code 143: killed by SIGTERM, as runtimes report it

    evidence = [from_event(e) for e in events if e.family == "tel"]
    world = World(ranks={a.rank: a.node for a in placed.data.assignments})
    finding = elect_first_error(evidence, world=world)
    assert finding.first_error is not None
    assert (finding.first_error.lane, finding.first_error.rank, finding.first_error.category) == (
        Lane.HOST,
        3,
        "oom_kill",
    )
    assert fold(events).current.cause is FailureCause.NODE_FAULT


@pytest.mark.parametrize("name", ["kueue-podsreadytimeout.ndjson", "jobset-oomkilled.ndjson", "node-states.ndjson"])
def test_a_relist_and_a_repeated_watch_event_publish_nothing_twice(name):
    observer = Observer()
    watch_events = stream(name)
    twice = [item for item in watch_events for _ in range(2)]
    once = replay(Observer(), watch_events)
    assert [e.id for e in replay(observer, twice)] == [e.id for e in once]  # a watch event delivered again
    latest: dict[str, dict[str, Any]] = {}
    for item in watch_events:
        if item["type"] != "DELETED":
            latest[item["object"]["metadata"]["uid"]] = item["object"]
    relisted = [{"type": "ADDED", "object": obj} for obj in latest.values()]
    assert replay(observer, relisted) == []


@pytest.mark.parametrize("name", ["kueue-podsreadytimeout.ndjson", "jobset-oomkilled.ndjson", "node-states.ndjson"])
def test_a_restart_from_saved_memory_at_any_point_publishes_what_an_uninterrupted_run_does(name):
    watch_events = stream(name)
    expected = [e.id for e in replay(Observer(), watch_events)]
    for cut in range(len(watch_events) + 1):
        before = Observer()
        ids = [e.id for e in replay(before, watch_events[:cut])]
        saved = before.memory.model_dump_json()
        after = Observer(ObserverMemory.model_validate_json(saved))
        ids += [e.id for e in replay(after, watch_events[cut:])]
        assert ids == expected, cut


def test_node_conditions_cordons_and_taints_are_node_states_with_their_lane():
    events = replay(Observer(), stream("node-states.ndjson"))
    states = [(e.node, e.data.state, e.lane) for e in events if isinstance(e, NodeStateChanged)]
    assert states == [
        ("gpu-node-1-cluster-local", NodeState.CORDONED, Lane.PLATFORM),
        ("gpu-node-1-cluster-local", NodeState.UNHEALTHY, Lane.HOST),
        ("gpu-node-1-cluster-local", NodeState.UNHEALTHY, Lane.NETWORK),
        ("gpu-node-1-cluster-local", NodeState.READY, Lane.HOST),
    ]
    assert "NodeStatusUnknown" in events[1].data.reason


def test_every_event_goes_through_the_codec():
    for name in ("kueue-podsreadytimeout.ndjson", "jobset-oomkilled.ndjson", "node-states.ndjson"):
        for event in replay(Observer(), stream(name)):
            encoded = encode(event)
            assert decode(encoded.subject, encoded.headers, encoded.payload) == event


@pytest.mark.parametrize(
    ("reason", "message", "expected"),
    [
        ("Pending", "couldn't assign flavors to pod set main: insufficient quota for nvidia.com/gpu", "capacity_short"),
        (
            "Pending",
            "couldn't assign flavors to pod set main: flavor h100 doesn't match node affinity",
            "spec_mismatch",
        ),
        ("Pending", "couldn't assign flavors to pod set main: untolerated taint {gpu: a100}", "spec_mismatch"),
        (
            "Pending",
            "cannot fit in any topology domain at level cloud.provider.com/topology-block",
            "topology_unsatisfiable",
        ),
        ("ClusterQueueStopped", "ClusterQueue cluster-queue is stopped", "isolated"),
        ("Inadmissible", "LocalQueue user-queue doesn't exist", "isolated"),
        ("Pending", "", "capacity_short"),
    ],
)
def test_kueue_pending_reasons_become_lanes_wait_reasons(reason, message, expected):
    assert wait_reason(reason, message)[0] == expected


def _pod(labels: dict[str, str], *, uid: str = "p-1") -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ns", "uid": uid, "labels": labels},
        "spec": {"containers": [{"name": "main"}]},
        "status": {},
    }


def test_a_pytorchjobs_ranks_come_from_replica_type_and_index_in_pod_set_order():
    observer = Observer()
    workload = {
        "kind": "Workload",
        "metadata": {
            "name": "pytorchjob-ddp",
            "namespace": "ns",
            "uid": "w-1",
            "ownerReferences": [{"kind": "PyTorchJob", "name": "ddp", "uid": "o", "controller": True}],
        },
        "spec": {"queueName": "q", "podSets": [{"name": "master", "count": 1}, {"name": "worker", "count": 3}]},
        "status": {
            "conditions": [{"type": "Admitted", "status": "True", "lastTransitionTime": "2026-12-07T10:00:00Z"}]
        },
    }
    observer.apply("Workload", "ADDED", workload)
    job = next(iter(observer.memory.jobs.values()))
    labels = {"training.kubeflow.org/job-name": "ddp", "training.kubeflow.org/replica-type": "worker"}
    pod = pod_of(_pod(labels | {"training.kubeflow.org/replica-index": "2"}))
    assert rank_of(pod, job) == 3
    master = {"training.kubeflow.org/job-name": "ddp", "training.kubeflow.org/replica-type": "master"}
    assert rank_of(pod_of(_pod(master | {"training.kubeflow.org/replica-index": "0"})), job) == 0


def test_bad_objects_are_refused_with_a_clear_error():
    with pytest.raises(K8sObjectError, match=r"metadata\.uid"):
        Observer().apply("Pod", "ADDED", {"kind": "Pod", "metadata": {"name": "x"}})
    with pytest.raises(K8sObjectError, match="podSets"):
        Observer().apply("Workload", "ADDED", {"metadata": {"name": "w", "uid": "u"}, "spec": {}})
    with pytest.raises(K8sObjectError, match="RFC 3339"):
        Observer().apply("Node", "ADDED", {"metadata": {"name": "n", "uid": "u", "creationTimestamp": "yesterday"}})
    with pytest.raises(K8sObjectError, match="does not watch"):
        Observer().apply("ConfigMap", "ADDED", {"metadata": {"name": "c", "uid": "u"}})


def test_a_pod_of_a_multi_pod_workload_without_an_index_is_refused():
    observer = Observer()
    events = replay(observer, stream("kueue-podsreadytimeout.ndjson")[:2])
    assert events
    pod = _pod({"batch.kubernetes.io/job-name": "train"}, uid="p-2")
    pod["metadata"]["namespace"] = "team-a"
    pod["metadata"]["creationTimestamp"] = "2026-12-07T10:00:06Z"
    with pytest.raises(K8sObjectError, match="rank"):
        observer.apply("Pod", "ADDED", pod)


def test_pods_read_before_their_workloads_admission_are_ranks_once_it_is_read():
    # Each kind has its own watch: the pods' watch may deliver before the Workload's.
    items = stream("kueue-podsreadytimeout.ndjson")
    reordered = [items[0], items[2], items[3], items[1], *items[4:]]
    assert sorted(e.id for e in replay(Observer(), reordered)) == sorted(e.id for e in replay(Observer(), items))
