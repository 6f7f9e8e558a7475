"""Unit tests for ``lanes_contract.codec``: CloudEvents 1.0 binary mode out, binary or structured mode in."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from lanes_contract import codec
from lanes_contract.codec import (
    MSG_ID_HEADER,
    STRUCTURED_JSON,
    EncodedEvent,
    decode,
    encode,
    register_upcaster,
    to_structured,
)
from lanes_contract.errors import DecodeError, InvalidEventError
from lanes_contract.events import (
    EVENT_TYPES,
    Event,
    Family,
    JobPlaced,
    JobPlacedData,
    JobStateChanged,
    JobStateChangedData,
    JobSubmitted,
    JobSubmittedData,
    JobWaiting,
    JobWaitingData,
    Lane,
    NodeRegistered,
    NodeRegisteredData,
    RankAssignment,
    RankExited,
    RankExitedData,
    RankStarted,
    RankStartedData,
    ResourcesReleased,
    ResourcesReleasedData,
)
from lanes_contract.jobs import JobSpec, JobState, ProtectionMode

TIME = datetime(2026, 12, 2, 10, 20, 11, 123456, tzinfo=UTC)
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
CAUSE_ID = "01937a1e-0000-7000-8000-000000000001"
RFC3339_MICROS_Z = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z$")

_JOB_KEYS: dict[str, Any] = {
    "time": TIME,
    "jobid": "job-1",
    "attempt": 1,
    "causationid": CAUSE_ID,
    "correlationid": "corr-1",
    "traceparent": TRACEPARENT,
    "subject": "train-llm",
}


def _samples() -> dict[str, Event]:
    """One valid, fully populated instance of every event type, by type."""
    events: list[Event] = [
        JobSubmitted(
            id="01937a1e-0001-7000-8000-000000000001",
            source="lanes/api",
            data=JobSubmittedData(
                spec=JobSpec(
                    name="train-llm",
                    workers=2,
                    gpus_per_worker=4,
                    gpu_model="H100",
                    command=("python", "train.py", "--lr=3e-4"),
                )
            ),
            **_JOB_KEYS,
        ),
        JobWaiting(
            id="01937a1e-0002-7000-8000-000000000002",
            source="lanes/scheduler",
            data=JobWaitingData(reason="capacity_short", detail="needs 8 GPUs; 4 are free", queue_position=3),
            **_JOB_KEYS,
        ),
        JobPlaced(
            id="01937a1e-0003-7000-8000-000000000003",
            source="lanes/scheduler",
            data=JobPlacedData(
                assignments=(
                    RankAssignment(rank=0, node="node-1", gpus=(0, 1, 2, 3)),
                    RankAssignment(rank=1, node="node-2", gpus=(4, 5, 6, 7)),
                )
            ),
            **_JOB_KEYS,
        ),
        RankStarted(
            id="01937a1e-0004-7000-8000-000000000004",
            source="agent/node-1",
            node="node-1",
            rank=0,
            data=RankStartedData(pid=4242),
            **_JOB_KEYS,
        ),
        RankExited(
            id="01937a1e-0005-7000-8000-000000000005",
            source="agent/node-2",
            node="node-2",
            rank=1,
            data=RankExitedData(exit_code=137),
            **_JOB_KEYS,
        ),
        JobStateChanged(
            id="01937a1e-0006-7000-8000-000000000006",
            source="lanes/lifecycle",
            data=JobStateChangedData(
                from_state=JobState.QUEUED,
                to_state=JobState.ADMITTED,
                cause_type="io.lanes.job.placed.v1",
                reason="placed",
            ),
            **_JOB_KEYS,
        ),
        ResourcesReleased(
            id="01937a1e-0007-7000-8000-000000000007",
            source="lanes/scheduler",
            data=ResourcesReleasedData(nodes=("node-1", "node-2"), gpus=8),
            **_JOB_KEYS,
        ),
        NodeRegistered(
            id="01937a1e-0008-7000-8000-000000000008",
            source="agent/node-1",
            time=TIME,
            node="node-1",
            traceparent=TRACEPARENT,
            # Non-ASCII on purpose: the payload is UTF-8 JSON.
            data=NodeRegisteredData(
                gpu_model="H100", gpus=8, gpu_memory_gib=80, labels={"rack": "r1", "site": "Zürich"}
            ),
        ),
        *_lifecycle_samples(),
        *_telemetry_samples(),
        *_scheduler_samples(),
        *_router_samples(),
        *_recovery_samples(),
    ]
    return {event.type: event for event in events}


def _scheduler_samples() -> list[Event]:
    from lanes_contract import events as ev  # noqa: PLC0415 - keeps the scheduler's samples in one place
    from lanes_contract.topology import ClusterPolicy, NodeState, Pool, Tenant  # noqa: PLC0415

    policy = ClusterPolicy(
        pools=(Pool(name="reserved", reserved_for=("research",)),),
        tenants=(Tenant(name="research", gpu_quota={"training": 64}),),
    )
    return [
        ev.JobRejected(
            source="lanes/scheduler",
            data=ev.JobRejectedData(reason="spec_mismatch", detail="no node has 8 GPUs of B200", figures={"n": 1}),
            **_JOB_KEYS,
        ),
        ev.NodeStateChanged(
            source="agent/node-1",
            node="node-1",
            lane=ev.Lane.HOST,
            data=ev.NodeStateChangedData(state=NodeState.UNHEALTHY, reason="GPU Xid 79"),
        ),
        ev.ClusterPolicySet(source="lanes/topology", data=ev.ClusterPolicySetData(policy=policy)),
    ]


def _lifecycle_samples() -> list[Event]:
    from lanes_contract import events as ev  # noqa: PLC0415 - keeps the lifecycle's samples in one place

    rank_keys = _JOB_KEYS | {"source": "agent/node-1", "node": "node-1", "rank": 0}
    digest = "sha256:" + "ab" * 32
    command = ev.CommandData(reason="r", requested_by="alice")
    samples: list[Event] = [
        ev.RendezvousDone(data=ev.RendezvousDoneData(world_size=2), **rank_keys),
        ev.CommunicatorReady(data=ev.CommunicatorReadyData(backend="nccl"), **rank_keys),
        ev.CheckpointStarted(data=ev.CheckpointStartedData(step=100), **rank_keys),
        ev.CheckpointSaved(data=ev.CheckpointSavedData(step=100, path="s3://c/100", digest=digest), **rank_keys),
        ev.ArtifactProduced(data=ev.ArtifactProducedData(artifact="model", path="s3://m", digest=digest), **rank_keys),
        ev.Heartbeat(data=ev.HeartbeatData(step=101), **rank_keys),
        ev.Heartbeat(
            data=ev.HeartbeatData(step=102, timings=(ev.StepTiming(step=102, compute_s=0.91, wait_s=0.12),)),
            **rank_keys,
        ),
        ev.CancelRequested(source="lanes/cli", data=command, **_JOB_KEYS),
        ev.DrillInjected(
            source="lanes/cli",
            data=ev.DrillInjectedData(kind=ev.DrillKind.HANG, node="node-1", rank=0, pid=4242, duration_s=5),
            **_JOB_KEYS,
        ),
        ev.AgentHeartbeat(
            source="agent/node-1",
            node="node-1",
            data=ev.AgentHeartbeatData(
                agent="agent-node-1",
                started_at=datetime(2026, 12, 4, 6, 0, tzinfo=UTC),
                interval_s=10,
                running_ranks=2,
                kernel_log="following",
                inventory=ev.NodeInventory(
                    source="nvidia-smi",
                    hostname="gpu-host-1",
                    cpus=96,
                    memory_gib=2015.6,
                    driver_version="550.90.07",
                    gpus=(
                        ev.GpuDevice(
                            index=0,
                            name="NVIDIA H100 80GB HBM3",
                            uuid="GPU-1",
                            pci_bus_id="00000000:18:00.0",
                            memory_mib=81559,
                            ecc_uncorrected=0,
                        ),
                    ),
                ),
            ),
        ),
        ev.RetryRequested(
            source="lanes/recovery",
            data=ev.RetryData(reason="r", resume_step=100, avoid_nodes=("node-1",)),
            **_JOB_KEYS,
        ),
        ev.HoldRequested(source="lanes/cli", data=ev.HoldRequestedData(owner="bob", deadline=TIME), **_JOB_KEYS),
        ev.ResumeRequested(
            source="lanes/cli", data=ev.RetryData(reason="r", requested_by="alice", resume_step=50), **_JOB_KEYS
        ),
        ev.AttemptRequested(
            source="lanes/lifecycle",
            data=ev.AttemptRequestedData(reason="r", resume_step=100, avoid_nodes=("node-1",)),
            **_JOB_KEYS,
        ),
        ev.TransitionRejected(
            source="lanes/lifecycle",
            data=ev.TransitionRejectedData(event_type="x", event_id="y", state=JobState.RUNNING, reason="z"),
            **_JOB_KEYS,
        ),
    ]
    return samples


def _telemetry_samples() -> list[Event]:
    from lanes_contract import events as ev  # noqa: PLC0415 - keeps the telemetry's samples in one place

    tel_keys: dict[str, Any] = {"time": TIME, "source": "agent/node-1", "node": "node-1", "traceparent": TRACEPARENT}
    timeout = ev.EvidenceData(
        category=ev.EvidenceCategory.COLLECTIVE_TIMEOUT,
        summary="rank 3 timed out in ALLREDUCE SeqNum=1580",
        lines=("[rank3]:[E1202 10:20:11.123456 77 ProcessGroupNCCL.cpp:632] [Rank 3] Watchdog caught ...",),
        origin="rank3.log",
        op_type="ALLREDUCE",
        seq_num=1580,
        timeout_ms=600000,
        last_enqueued=1580,
        last_completed=1579,
    )
    xid = ev.EvidenceData(category=ev.EvidenceCategory.GPU_XID, xid=79, gpu="0000:3b:00", lines=("NVRM: Xid ...",))
    cause = ev.FindingCause(
        category="oom_kill", lane=Lane.HOST, node="node-1", rank=3, time=TIME, summary="oom", evidence=("x",)
    )
    finding = ev.JobFindingData(
        version=2,
        first_error=cause,
        consequences=(ev.ConsequenceGroup(category="collective_timeout", summary="s", count=2, ranks=(1, 2)),),
        stage="steady_state",
        missing_evidence=(ev.MissingEvidence(lane=Lane.HOST, what="kernel log", node="node-2"),),
        confidence=0.9,
        owner="host on-call",
        evidence_count=4,
    )
    return [
        ev.CommunicationEvidence(rank=3, jobid="job-1", attempt=1, data=timeout, **tel_keys),
        ev.ProcessEvidence(data=ev.EvidenceData(category=ev.EvidenceCategory.PROCESS_EXITED, signal=9), **tel_keys),
        ev.HostEvidence(data=xid, **tel_keys),
        ev.NetworkEvidence(
            data=ev.EvidenceData(category=ev.EvidenceCategory.LINK_DOWN, interface="ibp94s0"), **tel_keys
        ),
        ev.PlatformEvidence(data=ev.EvidenceData(category=ev.EvidenceCategory.PREEMPTION), **tel_keys),
        ev.RawEvidence(data=ev.EvidenceData(category=ev.EvidenceCategory.RAW, lines=("??",)), **tel_keys),
        ev.JobEvidence(
            source="lanes/telemetry",
            node="node-1",
            rank=3,
            data=ev.JobEvidenceData(evidence_id="e1", evidence=timeout),
            **_JOB_KEYS,
        ),
        ev.JobFinding(source="lanes/telemetry", data=finding, **_JOB_KEYS),
        ev.JobSlowdown(
            source="lanes/telemetry",
            rank=5,
            node="node-3",
            data=ev.JobSlowdownData(
                kind="compute_straggler",
                rank=5,
                node="node-3",
                onset_step=1200,
                slowdown=0.38,
                lost_s=412.5,
                gpu_hours=7.33,
                votes=0.97,
                summary="rank 5: step time +38% since step 1,200 (compute_straggler)",
            ),
            **_JOB_KEYS,
        ),
    ]


def _router_samples() -> list[Event]:
    from lanes_contract import events as ev  # noqa: PLC0415 - keeps the router's samples in one place

    replica = ev.ReplicaStateChangedData(
        replica="chat-a",
        model="tiny-chat",
        version="v1",
        state=ev.ReplicaState.UNHEALTHY,
        previous=ev.ReplicaState.READY,
        reason="3 errors in a row",
        signal="passive",
        endpoint="http://127.0.0.1:8000",
        gpus=(0,),
        penalty_s=2.0,
    )
    tried = ev.RequestAttempt(
        replica="chat-a", node="node-1", outcome="refused", detail="connection refused", elapsed_ms=1.5
    )
    served = ev.RequestServedData(
        request_id="req-1",
        model="tiny-chat",
        version="v1",
        replica="chat-b",
        gpus=(1,),
        endpoint="http://127.0.0.1:8001",
        route="/v1/chat/completions",
        stream=True,
        status="ok",
        http_status=200,
        attempts=(tried, ev.RequestAttempt(replica="chat-b", node="node-2", outcome="ok", elapsed_ms=20.0)),
        received_at=TIME,
        ttft_ms=3.2,
        latency_ms=21.5,
        prompt_tokens=5,
        completion_tokens=16,
        router="router-1",
    )
    return [
        ev.ReplicaListening(
            source="agent/node-1",
            node="node-1",
            rank=0,
            data=ev.ReplicaListeningData(endpoint="http://127.0.0.1:8000"),
            **_JOB_KEYS,
        ),
        ev.ReplicaStateChanged(source="lanes/router", node="node-1", data=replica, **_JOB_KEYS),
        ev.RequestServed(source="lanes/router", jobid="chat-b", attempt=1, node="node-2", data=served),
    ]


def _recovery_samples() -> list[Event]:
    from lanes_contract import events as ev  # noqa: PLC0415 - keeps the recovery's samples in one place

    digest = "sha256:" + "cd" * 32
    checkpoint = ev.CheckpointRef(attempt=1, step=200, path="/ckpt/200", digest=digest)
    decision = ev.RecoveryDecidedData(
        finding_id="f-1",
        finding_version=2,
        first_error="host/oom_kill",
        policy="training-default",
        policy_version=1,
        workload_class="training",
        action=ev.RecoveryAction.RESUME,
        reason="host-lane first error: cordon node-1 and resume",
        owner="host on-call",
        owner_lane=Lane.HOST,
        rollback="lanes topology state node-1 ready; lanes cancel job-1",
        expects="io.lanes.job.attempt_requested.v1",
        cordon=("node-1",),
        checkpoint=checkpoint,
        refused=(
            ev.RefusedCheckpoint(checkpoint=checkpoint, field="digest", expected=digest, found="sha256:00000000"),
        ),
        lost_work=ev.LostWork(steps=40, gpus=8, step_time_s=0.5, gpu_hours=0.04),
        backoff_s=1.0,
        deadline=TIME,
        retries_used=1,
        manual_action=ev.ManualAction.ROLLBACK,
        requested_by="alice",
        protection=ProtectionMode.QUEUE,
        resume_step=200,
    )
    escalated = ev.RecoveryEscalatedData(
        decision_id="d-1", owner="alice", owner_lane=Lane.ALGORITHM, deadline=TIME, reason="no decision"
    )
    manual = ev.ManualActionData(action=ev.ManualAction.APPROVE, reason="fixed the data", requested_by="alice")
    superseded = ev.RecoverySupersededData(
        decision_id="d-1",
        decided_on=ev.Culprit(lane=Lane.HOST, category="silent_node", node="node-1"),
        decided_version=1,
        finding_id="f-3",
        finding_version=3,
        culprit=ev.Culprit(lane=Lane.HOST, category="oom_kill", node="node-3", rank=2),
        uncordon=("node-1",),
        replanned=True,
        reason="decided on node-1 at v1; the settled finding v3 names node-3",
    )
    window = ev.SettleWindowEndedData(ended_at=TIME, window_s=5.0)
    return [
        ev.RecoveryDecided(source="lanes/recovery", data=decision, **_JOB_KEYS),
        ev.RecoveryEscalated(source="lanes/recovery", data=escalated, **_JOB_KEYS),
        ev.RecoverySuperseded(source="lanes/recovery", data=superseded, **_JOB_KEYS),
        ev.SettleWindowEnded(source="lanes/telemetry", data=window, **_JOB_KEYS),
        ev.ManualActionRequested(source="lanes/cli", data=manual, **_JOB_KEYS),
    ]


SAMPLES = _samples()
ENCODED = {event_type: encode(event) for event_type, event in SAMPLES.items()}


def _minimal(event: Event) -> Event:
    """The same event with only the required attributes (no optional `ce-` extensions)."""
    keys: dict[str, Any] = {"jobid": event.jobid} if event.family is Family.JOB else {"node": event.node}
    if event.family is Family.REQUEST:
        keys = {}
    return type(event).model_validate({"source": event.source, "data": event.data, **keys})


def _decode_encoded(encoded: EncodedEvent) -> Event:
    return decode(encoded.subject, encoded.headers, encoded.payload)


# --- round trips ---------------------------------------------------------------------------------


def test_samples_cover_the_whole_catalogue():
    # A new event type must get a sample here, or the round-trip tests below silently skip it.
    assert set(SAMPLES) == set(EVENT_TYPES)
    assert all(type(event) is EVENT_TYPES[event_type] for event_type, event in SAMPLES.items())


@pytest.mark.parametrize("event_type", sorted(EVENT_TYPES))
def test_binary_mode_round_trip(event_type):
    event = SAMPLES[event_type]
    decoded = _decode_encoded(encode(event))
    assert type(decoded) is type(event)
    assert decoded == event


@pytest.mark.parametrize("event_type", sorted(EVENT_TYPES))
def test_binary_mode_round_trip_with_only_required_attributes(event_type):
    event = _minimal(SAMPLES[event_type])
    encoded = encode(event)
    assert decode(encoded.subject, encoded.headers, encoded.payload) == event
    # Unset optional attributes are left out, not sent as "None".
    assert "None" not in encoded.headers.values()
    assert not {"ce-attempt", "ce-rank", "ce-causationid", "ce-correlationid", "traceparent"} & set(encoded.headers)


@pytest.mark.parametrize("event_type", sorted(EVENT_TYPES))
def test_structured_mode_round_trip(event_type):
    event = SAMPLES[event_type]
    body = json.dumps(to_structured(event)).encode()
    subject = event.nats_subject()
    assert decode(subject, {"Content-Type": STRUCTURED_JSON}, body) == event
    # A structured body is recognised by its specversion even without a content type.
    assert decode(subject, None, body) == event
    assert decode(subject, {}, body) == event


def test_structured_mode_object_shape():
    event = SAMPLES["io.lanes.job.rank_exited.v1"]
    structured = to_structured(event)
    assert structured["specversion"] == "1.0"
    assert structured["datacontenttype"] == "application/json"
    assert structured["id"] == event.id
    assert structured["type"] == "io.lanes.job.rank_exited.v1"
    assert structured["time"] == "2026-12-02T10:20:11.123456Z"
    assert structured["traceparent"] == TRACEPARENT
    assert structured["data"] == {
        "exit_code": 137,
        "signal": None,
        "evidence": None,
        "start_error": None,
        "killed_after_grace_s": None,
        "lost": None,
    }


def test_header_names_are_case_insensitive_on_decode():
    encoded = ENCODED["io.lanes.job.placed.v1"]
    shouted = {key.upper(): value for key, value in encoded.headers.items()}
    assert decode(encoded.subject, shouted, encoded.payload) == SAMPLES["io.lanes.job.placed.v1"]


def test_transport_headers_are_not_needed_to_decode():
    encoded = ENCODED["io.lanes.job.placed.v1"]
    headers = {k: v for k, v in encoded.headers.items() if k not in {"Content-Type", MSG_ID_HEADER}}
    assert decode(encoded.subject, headers, encoded.payload) == SAMPLES["io.lanes.job.placed.v1"]


@pytest.mark.parametrize(
    "moment",
    [
        datetime(2026, 12, 2, 12, 20, 11, 123456, tzinfo=timezone(timedelta(hours=2))),
        datetime(2026, 12, 2, 5, 50, 11, 123456, tzinfo=timezone(timedelta(hours=-4, minutes=-30))),
    ],
)
def test_time_in_another_offset_is_sent_in_utc_and_decodes_to_the_same_instant(moment):
    event = SAMPLES["io.lanes.job.waiting.v1"].model_copy(update={"time": moment})
    encoded = encode(event)
    assert encoded.headers["ce-time"] == "2026-12-02T10:20:11.123456Z"
    decoded = _decode_encoded(encoded)
    assert decoded.time == moment
    assert decoded.time.utcoffset() == timedelta(0)


_tokens = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,20}", fullmatch=True)


_waiting_events = st.builds(
    JobWaiting,
    # Header-bound text carries no control characters (they could inject headers), so none are generated.
    source=st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=40),
    jobid=_tokens,
    attempt=st.none() | st.integers(min_value=1, max_value=10**6),
    time=st.datetimes(
        min_value=datetime(2000, 1, 1),  # noqa: DTZ001 - bounds of a naive strategy; the timezone is drawn below
        max_value=datetime(2100, 1, 1),  # noqa: DTZ001
        timezones=st.builds(timezone, st.timedeltas(min_value=timedelta(hours=-23), max_value=timedelta(hours=23))),
    ),
    data=st.builds(
        JobWaitingData,
        reason=st.text(min_size=1, max_size=60),
        detail=st.text(max_size=60),
        queue_position=st.none() | st.integers(min_value=1, max_value=10**9),
    ),
)


@settings(max_examples=150, deadline=None)
@given(event=_waiting_events)
def test_round_trip_property(event):
    encoded = encode(event)
    assert _decode_encoded(encoded) == event
    assert decode(encoded.subject, None, json.dumps(to_structured(event)).encode()) == event


# --- headers -------------------------------------------------------------------------------------


def test_binary_mode_headers():
    event = SAMPLES["io.lanes.job.rank_exited.v1"]
    encoded = encode(event)
    headers = encoded.headers
    assert encoded.subject == "lanes.job.job-1.rank_exited"
    assert headers["ce-specversion"] == "1.0"
    assert headers["ce-id"] == event.id
    assert headers[MSG_ID_HEADER] == f"lanes.job.job-1.rank_exited/{event.id}"
    assert headers["ce-source"] == "agent/node-2"
    assert headers["ce-type"] == "io.lanes.job.rank_exited.v1"
    assert headers["ce-time"] == "2026-12-02T10:20:11.123456Z"
    assert headers["ce-subject"] == "train-llm"
    assert headers["ce-lane"] == "host"
    assert headers["ce-jobid"] == "job-1"
    assert headers["ce-attempt"] == "1"
    assert headers["ce-node"] == "node-2"
    assert headers["ce-rank"] == "1"
    assert headers["ce-causationid"] == CAUSE_ID
    assert headers["ce-correlationid"] == "corr-1"
    assert headers["Content-Type"] == "application/json"
    # The W3C trace context keeps its own name (CloudEvents distributed-tracing extension).
    assert headers["traceparent"] == TRACEPARENT
    assert "ce-traceparent" not in headers
    assert all(isinstance(value, str) for value in headers.values())


@pytest.mark.parametrize("event_type", sorted(EVENT_TYPES))
def test_every_header_is_a_ce_attribute_or_a_known_transport_header(event_type):
    headers = ENCODED[event_type].headers
    others = {key for key in headers if not key.startswith("ce-")}
    assert others <= {"traceparent", "Content-Type", MSG_ID_HEADER}
    assert headers["ce-id"] == SAMPLES[event_type].id
    assert headers[MSG_ID_HEADER] == f"{ENCODED[event_type].subject}/{SAMPLES[event_type].id}"
    assert RFC3339_MICROS_Z.match(headers["ce-time"])
    # The envelope travels in headers only; the payload is the event's data alone.
    payload = json.loads(ENCODED[event_type].payload)
    assert isinstance(payload, dict)
    assert not {"id", "type", "source", "specversion", "time"} & set(payload)


def test_ce_time_always_has_six_fraction_digits():
    event = SAMPLES["io.lanes.job.waiting.v1"].model_copy(update={"time": datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)})
    assert encode(event).headers["ce-time"] == "2026-01-02T03:04:05.000000Z"


def test_payload_is_compact_utf8_json_of_the_data():
    assert json.loads(ENCODED["io.lanes.job.waiting.v1"].payload) == {
        "reason": "capacity_short",
        "detail": "needs 8 GPUs; 4 are free",
        "queue_position": 3,
        "owner_lane": None,
        "blocking": [],
        "figures": {},
    }
    node_payload = ENCODED["io.lanes.node.registered.v1"].payload
    assert "Zürich".encode() in node_payload
    assert b", " not in node_payload
    assert b": " not in node_payload


def test_node_event_subject_uses_the_node_id():
    assert ENCODED["io.lanes.node.registered.v1"].subject == "lanes.node.node-1.registered"


# --- invalid events never leave the producer -----------------------------------------------------


def _construct_waiting(**overrides: Any) -> JobWaiting:
    fields: dict[str, Any] = {
        "id": "01937a1e-0002-7000-8000-000000000002",
        "source": "lanes/scheduler",
        "type": "io.lanes.job.waiting.v1",
        "time": TIME,
        "lane": Lane.PLATFORM,
        "jobid": "job-1",
        "data": JobWaitingData(reason="capacity_short"),
    }
    return JobWaiting.model_construct(**(fields | overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"jobid": "job.1"}, id="jobid-with-dot"),
        pytest.param({"jobid": None}, id="job-event-without-jobid"),
        pytest.param({"source": ""}, id="empty-source"),
        pytest.param({"attempt": 0}, id="attempt-zero"),
        pytest.param({"rank": -1}, id="negative-rank"),
        pytest.param({"traceparent": "not-a-traceparent"}, id="bad-traceparent"),
        pytest.param(
            {"lane": "kitchen"},
            id="unknown-lane",
            # pydantic warns while dumping the unvalidated enum field; the point is what encode does next.
            marks=pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning"),
        ),
        pytest.param({"data": JobWaitingData.model_construct(reason="")}, id="empty-wait-reason"),
    ],
)
def test_encode_rejects_an_event_that_skipped_validation(overrides):
    event = _construct_waiting(**overrides)
    with pytest.raises(InvalidEventError, match=re.escape("io.lanes.job.waiting.v1")):
        encode(event)


def test_the_constructed_baseline_is_valid():
    # Guards the test above: without overrides the constructed event encodes fine.
    assert _decode_encoded(encode(_construct_waiting())) == _construct_waiting()


def test_encode_rejects_a_model_copy_that_broke_a_field():
    event = SAMPLES["io.lanes.job.rank_started.v1"].model_copy(update={"node": "node 1"})
    with pytest.raises(InvalidEventError):
        encode(event)


def test_invalid_event_error_is_a_value_error():
    assert issubclass(InvalidEventError, ValueError)


# --- decode rejects what is not a valid Lanes event ----------------------------------------------


@pytest.mark.parametrize(
    "subject",
    [
        "lanes.job.job-2.rank_exited",  # another job
        "lanes.job.job-1.rank_started",  # another event name
        "lanes.node.node-2.rank_exited",  # another family
        "lanes.job.job-1.rank_exited.extra",
        "",
    ],
)
def test_decode_rejects_a_subject_that_does_not_match_the_join_keys(subject):
    encoded = ENCODED["io.lanes.job.rank_exited.v1"]
    with pytest.raises(DecodeError, match="does not match"):
        decode(subject, encoded.headers, encoded.payload)
    with pytest.raises(DecodeError, match="does not match"):
        decode(subject, None, json.dumps(to_structured(SAMPLES["io.lanes.job.rank_exited.v1"])).encode())


_WAITING = ENCODED["io.lanes.job.waiting.v1"]


def _with_headers(drop: tuple[str, ...] = (), **replace: str) -> dict[str, str]:
    headers = {k: v for k, v in _WAITING.headers.items() if k not in drop}
    return headers | {k.replace("_", "-"): v for k, v in replace.items()}


@pytest.mark.parametrize(
    ("headers", "payload"),
    [
        pytest.param(_with_headers(ce_type="io.lanes.job.exploded.v1"), _WAITING.payload, id="unknown-type"),
        pytest.param(_with_headers(ce_type="io.lanes.job.waiting.v2"), _WAITING.payload, id="future-version"),
        pytest.param(_with_headers(ce_specversion="0.3"), _WAITING.payload, id="specversion-0.3"),
        pytest.param(_with_headers(ce_specversion="1"), _WAITING.payload, id="specversion-1"),
        pytest.param(_with_headers(ce_specversion=""), _WAITING.payload, id="specversion-empty"),
        pytest.param(_with_headers(drop=("ce-type",)), _WAITING.payload, id="missing-ce-type"),
        pytest.param(_with_headers(drop=("ce-source",)), _WAITING.payload, id="missing-ce-source"),
        pytest.param(_with_headers(drop=("ce-specversion",)), _WAITING.payload, id="missing-specversion"),
        pytest.param({}, _WAITING.payload, id="no-headers"),
        pytest.param(_with_headers(ce_time="yesterday"), _WAITING.payload, id="bad-time"),
        pytest.param(_with_headers(ce_time="2026-12-02T10:20:11"), _WAITING.payload, id="naive-time"),
        pytest.param(_with_headers(ce_attempt="0"), _WAITING.payload, id="attempt-zero"),
        pytest.param(_with_headers(ce_attempt="one"), _WAITING.payload, id="attempt-not-a-number"),
        pytest.param(_with_headers(ce_lane="kitchen"), _WAITING.payload, id="unknown-lane"),
        pytest.param(_with_headers(traceparent="00-xyz"), _WAITING.payload, id="bad-traceparent"),
        pytest.param(_with_headers(), b"not json", id="payload-not-json"),
        pytest.param(_with_headers(), b"", id="payload-empty"),
        pytest.param(_with_headers(), b"\xff\xfe\xfa", id="payload-not-utf8"),
        pytest.param(_with_headers(), b'{"reason": "x"', id="payload-truncated"),
        pytest.param(_with_headers(), b"[]", id="payload-array"),
        pytest.param(_with_headers(), b'"capacity_short"', id="payload-string"),
        pytest.param(_with_headers(), b"null", id="payload-null"),
        pytest.param(_with_headers(), b"{}", id="payload-missing-field"),
        pytest.param(_with_headers(), b'{"reason": 5}', id="payload-wrong-field-type"),
        pytest.param(_with_headers(), b'{"reason": "x", "bogus": 1}', id="payload-extra-field"),
        pytest.param(_with_headers(), b'{"reason": "x", "queue_position": 0}', id="payload-out-of-range"),
    ],
)
def test_decode_rejects_invalid_binary_messages(headers, payload):
    with pytest.raises(DecodeError):
        decode(_WAITING.subject, headers, payload)


def _structured_body(**changes: Any) -> bytes:
    body = to_structured(SAMPLES["io.lanes.job.waiting.v1"]) | changes
    return json.dumps({k: v for k, v in body.items() if v is not None}).encode()


@pytest.mark.parametrize(
    ("headers", "payload"),
    [
        pytest.param(None, _structured_body(specversion="0.3"), id="wrong-specversion"),
        pytest.param({"Content-Type": STRUCTURED_JSON}, _structured_body(specversion=None), id="no-specversion"),
        pytest.param(None, _structured_body(type="io.lanes.job.exploded.v1"), id="unknown-type"),
        pytest.param(None, _structured_body(type=None), id="missing-type"),
        pytest.param(None, _structured_body(data={"reason": 5}), id="data-wrong-shape"),
        pytest.param(None, _structured_body(data=None), id="no-data"),
        pytest.param({"Content-Type": STRUCTURED_JSON}, b"[1, 2]", id="array-body"),
        pytest.param({"Content-Type": STRUCTURED_JSON}, b"{not json", id="broken-json"),
        pytest.param({"Content-Type": STRUCTURED_JSON}, b"", id="empty-body"),
        pytest.param(None, b'{"hello": "world"}', id="plain-json-object"),
    ],
)
def test_decode_rejects_invalid_structured_messages(headers, payload):
    with pytest.raises(DecodeError):
        decode(_WAITING.subject, headers, payload)


# --- upcasters -----------------------------------------------------------------------------------


@pytest.fixture
def upcasters(monkeypatch):
    """A private upcaster registry, so tests never leak upcasters into each other."""
    registry: dict[str, codec.Upcaster] = {}
    monkeypatch.setattr(codec, "_UPCASTERS", registry)
    return registry


def _rank_exited_v0_to_v1(fields: dict[str, Any]) -> dict[str, Any]:
    data = dict(fields["data"])
    data["exit_code"] = data.pop("code")
    return {**fields, "type": "io.lanes.job.rank_exited.v1", "data": data}


_V0_HEADERS = {
    "ce-specversion": "1.0",
    "ce-id": "01937a1e-0009-7000-8000-000000000009",
    "ce-source": "agent/node-2",
    "ce-type": "io.lanes.job.rank_exited.v0",
    "ce-time": "2026-12-02T10:20:11.123456Z",
    "ce-lane": "host",
    "ce-jobid": "job-1",
    "ce-attempt": "1",
    "ce-node": "node-2",
    "ce-rank": "3",
}
_V0_PAYLOAD = b'{"code": 2}'
_V0_SUBJECT = "lanes.job.job-1.rank_exited"


def test_an_old_version_is_unreadable_without_its_upcaster(upcasters):
    with pytest.raises(DecodeError, match="unknown event type"):
        decode(_V0_SUBJECT, _V0_HEADERS, _V0_PAYLOAD)


def test_an_upcaster_turns_a_retired_version_into_the_current_type(upcasters):
    register_upcaster("io.lanes.job.rank_exited.v0", _rank_exited_v0_to_v1)
    event = decode(_V0_SUBJECT, _V0_HEADERS, _V0_PAYLOAD)
    assert isinstance(event, RankExited)
    assert event.type == "io.lanes.job.rank_exited.v1"
    assert event.data.exit_code == 2
    assert event.data.signal is None
    assert event.id == "01937a1e-0009-7000-8000-000000000009"
    assert (event.jobid, event.attempt, event.node, event.rank) == ("job-1", 1, "node-2", 3)
    assert event.time == TIME


def test_an_upcaster_also_applies_to_structured_mode(upcasters):
    register_upcaster("io.lanes.job.rank_exited.v0", _rank_exited_v0_to_v1)
    body = {key.removeprefix("ce-"): value for key, value in _V0_HEADERS.items()} | {"data": {"code": 1}}
    event = decode(_V0_SUBJECT, None, json.dumps(body).encode())
    assert isinstance(event, RankExited)
    assert event.data.exit_code == 1


def test_upcasters_chain(upcasters):
    def minus_one_to_v0(fields: dict[str, Any]) -> dict[str, Any]:
        data = {"code": fields["data"]["status"]}
        return {**fields, "type": "io.lanes.job.rank_exited.v0", "data": data}

    register_upcaster("io.lanes.job.rank_exited.v-1", minus_one_to_v0)
    register_upcaster("io.lanes.job.rank_exited.v0", _rank_exited_v0_to_v1)
    headers = _V0_HEADERS | {"ce-type": "io.lanes.job.rank_exited.v-1"}
    event = decode(_V0_SUBJECT, headers, b'{"status": 9}')
    assert isinstance(event, RankExited)
    assert event.data.exit_code == 9


def test_an_upcaster_that_produces_an_invalid_event_gives_a_decode_error(upcasters):
    register_upcaster("io.lanes.job.rank_exited.v0", lambda fields: {**fields, "type": "io.lanes.job.rank_exited.v1"})
    with pytest.raises(DecodeError):
        decode(_V0_SUBJECT, _V0_HEADERS, _V0_PAYLOAD)  # data still has "code", not "exit_code"


def test_an_upcaster_cycle_is_a_decode_error(upcasters):
    register_upcaster("io.lanes.x.v0", lambda fields: {**fields, "type": "io.lanes.x.v-1"})
    register_upcaster("io.lanes.x.v-1", lambda fields: {**fields, "type": "io.lanes.x.v0"})
    with pytest.raises(DecodeError, match="cycle"):
        decode(_V0_SUBJECT, _V0_HEADERS | {"ce-type": "io.lanes.x.v0"}, _V0_PAYLOAD)


@pytest.mark.parametrize("current_type", sorted(EVENT_TYPES))
def test_registering_an_upcaster_for_a_current_type_is_refused(upcasters, current_type):
    with pytest.raises(ValueError, match="current event type"):
        register_upcaster(current_type, _rank_exited_v0_to_v1)
    assert upcasters == {}


def test_the_upcaster_fixture_isolates_the_global_registry(upcasters):
    register_upcaster("io.lanes.job.rank_exited.v0", _rank_exited_v0_to_v1)
    assert codec._UPCASTERS is upcasters
    assert "io.lanes.job.rank_exited.v0" in upcasters


# --- regressions: defects these tests found -----------------------------------------------------


def test_a_rank_killed_by_a_signal_round_trips():
    # exit_code=None is required-but-nullable: dumping with exclude_none once dropped it and encode refused.
    event = RankExited(
        source="agent/node-1", jobid="job-1", node="node-1", rank=0, data=RankExitedData(exit_code=None, signal=9)
    )
    encoded = encode(event)
    assert json.loads(encoded.payload) == {
        "exit_code": None,
        "signal": 9,
        "evidence": None,
        "start_error": None,
        "killed_after_grace_s": None,
        "lost": None,
    }
    assert _decode_encoded(encoded) == event
    assert decode(encoded.subject, None, json.dumps(to_structured(event)).encode()) == event


def test_a_state_change_without_a_previous_state_round_trips():
    event = JobStateChanged(
        source="lanes/lifecycle",
        jobid="job-1",
        data=JobStateChangedData(from_state=None, to_state=JobState.SUBMITTED, cause_type="io.lanes.job.submitted.v1"),
    )
    encoded = encode(event)
    assert json.loads(encoded.payload)["from_state"] is None
    assert _decode_encoded(encoded) == event
    assert decode(encoded.subject, None, json.dumps(to_structured(event)).encode()) == event


@pytest.mark.parametrize("bad_type", [[1], {"a": 1}, 7, None])
def test_structured_body_with_a_non_string_type_is_a_decode_error(bad_type):
    # An unhashable `type` once raised TypeError from the upcaster lookup.
    body = json.dumps({"specversion": "1.0", "type": bad_type, "data": {}}).encode()
    with pytest.raises(DecodeError):
        decode(_WAITING.subject, None, body)


@pytest.mark.parametrize(
    "payload",
    [pytest.param(b"1" * 5000, id="huge-integer"), pytest.param(b"[" * 100_000, id="deep-nesting")],
)
def test_hostile_json_payload_is_a_decode_error(payload):
    # json.loads raises a plain ValueError (integer over 4300 digits) or RecursionError for these.
    with pytest.raises(DecodeError):
        decode(_WAITING.subject, _WAITING.headers, payload)
    body = b'{"specversion": "1.0", "type": "io.lanes.job.waiting.v1", "data": ' + payload + b"}"
    with pytest.raises(DecodeError):
        decode(_WAITING.subject, None, body)


# --- property: decode returns an Event or raises DecodeError, nothing else ------------------------

_CE_KEYS = [
    "ce-specversion",
    "ce-id",
    "ce-source",
    "ce-type",
    "ce-time",
    "ce-subject",
    "ce-lane",
    "ce-jobid",
    "ce-attempt",
    "ce-node",
    "ce-rank",
    "ce-causationid",
    "ce-correlationid",
    "traceparent",
    "Content-Type",
    "content-type",
    MSG_ID_HEADER,
]
_PLAUSIBLE_VALUES = [
    "1.0",
    "0.3",
    "",
    "job-1",
    "node-1",
    "1",
    "0",
    "-1",
    "host",
    "lanes/scheduler",
    "2026-12-02T10:20:11.123456Z",
    TRACEPARENT,
    "application/json",
    STRUCTURED_JSON,
    *EVENT_TYPES,
]
_header_dicts = st.dictionaries(
    keys=st.sampled_from(_CE_KEYS) | st.text(max_size=20),
    values=st.sampled_from(_PLAUSIBLE_VALUES) | st.text(max_size=40),
    max_size=16,
)
_subjects = st.sampled_from([e.subject for e in ENCODED.values()]) | st.text(max_size=40)


def _decodes_or_rejects(subject: str, headers: dict[str, str] | None, payload: bytes) -> Event | None:
    try:
        event = decode(subject, headers, payload)
    except DecodeError:
        return None
    assert isinstance(event, Event)
    assert event.nats_subject() == subject
    return event


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(subject=_subjects, headers=st.none() | _header_dicts, payload=st.binary(max_size=200))
def test_decode_of_arbitrary_headers_and_payload_never_raises_anything_but_decode_error(subject, headers, payload):
    _decodes_or_rejects(subject, headers, payload)


@settings(max_examples=200, deadline=None)
@given(
    sample=st.sampled_from(sorted(EVENT_TYPES)),
    headers=_header_dicts,
    data_payload=st.sampled_from([e.payload for e in ENCODED.values()]) | st.binary(max_size=120),
)
def test_decode_of_valid_type_with_random_attributes_never_raises_anything_but_decode_error(
    sample, headers, data_payload
):
    # Valid specversion and type, so decoding always gets as far as pydantic validation.
    merged = headers | {"ce-specversion": "1.0", "ce-type": sample}
    _decodes_or_rejects(ENCODED[sample].subject, merged, data_payload)


_json_scalars = (
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.floats(allow_nan=False) | st.text(max_size=20)
)
_json_values = st.recursive(
    _json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)
_ATTRIBUTE_NAMES = [key.removeprefix("ce-") for key in _CE_KEYS[:14]] + ["data", "datacontenttype"]


@settings(max_examples=200, deadline=None)
@given(
    sample=st.sampled_from(sorted(EVENT_TYPES)),
    changes=st.dictionaries(st.sampled_from(_ATTRIBUTE_NAMES) | st.text(max_size=10), _json_values, max_size=5),
    content_type=st.none() | st.just(STRUCTURED_JSON),
)
def test_decode_of_mutated_structured_bodies_never_raises_anything_but_decode_error(sample, changes, content_type):
    body = to_structured(SAMPLES[sample]) | changes
    headers = None if content_type is None else {"Content-Type": content_type}
    _decodes_or_rejects(ENCODED[sample].subject, headers, json.dumps(body).encode())


@st.composite
def _mutated_messages(draw: st.DrawFn) -> tuple[str, dict[str, str], bytes]:
    encoded = ENCODED[draw(st.sampled_from(sorted(ENCODED)))]
    headers = dict(encoded.headers)
    payload = bytearray(encoded.payload)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        mutation = draw(st.sampled_from(["drop", "replace", "flip", "truncate", "insert"]))
        if mutation == "drop" and headers:
            del headers[draw(st.sampled_from(sorted(headers)))]
        elif mutation == "replace" and headers:
            headers[draw(st.sampled_from(sorted(headers)))] = draw(st.text(max_size=40))
        elif mutation == "flip" and payload:
            index = draw(st.integers(min_value=0, max_value=len(payload) - 1))
            payload[index] ^= draw(st.integers(min_value=1, max_value=255))
        elif mutation == "truncate":
            payload = payload[: draw(st.integers(min_value=0, max_value=len(payload)))]
        elif mutation == "insert":
            index = draw(st.integers(min_value=0, max_value=len(payload)))
            payload[index:index] = draw(st.binary(min_size=1, max_size=8))
    return encoded.subject, headers, bytes(payload)


@settings(max_examples=400, deadline=None)
@given(message=_mutated_messages())
def test_decode_of_mutated_valid_messages_never_raises_anything_but_decode_error(message):
    subject, headers, payload = message
    _decodes_or_rejects(subject, headers, payload)


def test_an_unmutated_message_decodes():
    # Guards the mutation property: its starting points are valid messages.
    for encoded in ENCODED.values():
        assert _decodes_or_rejects(encoded.subject, encoded.headers, encoded.payload) is not None


def test_header_text_with_a_line_break_is_refused_at_construction() -> None:
    with pytest.raises(ValidationError, match="source"):
        JobSubmitted(
            source="agent\r\nNats-Msg-Id: forged",
            jobid="j1",
            data=JobSubmittedData(spec=JobSpec(name="x", workers=1)),
        )
