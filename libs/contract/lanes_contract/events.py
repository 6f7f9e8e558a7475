"""The one event catalogue: a frozen pydantic model per event type, discriminated by `type`.

Every event carries the CloudEvents 1.0 context attributes plus the Lanes join keys (lane, job id,
attempt, node, rank, causation and correlation ids, trace context). Each event type knows which subject
family it belongs to, so its NATS subject is derived from its own join keys and can never disagree with
them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal, TypeVar, get_args

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, StringConstraints, model_validator

from lanes_contract.ids import derived_event_id, new_event_id
from lanes_contract.jobs import Digest, FailureCause, JobSpec, JobState, ProtectionMode, Token
from lanes_contract.topology import ClusterPolicy, NodeState


class Lane(StrEnum):
    """The responsibility lane an event's evidence belongs to (DESIGN.md, "Lanes")."""

    ALGORITHM = "algorithm"
    PLATFORM = "platform"
    HOST = "host"
    NETWORK = "network"


class Family(StrEnum):
    """Subject families; each maps to one stream (see `lanes_contract.streams`)."""

    JOB = "job"
    NODE = "node"
    TELEMETRY = "tel"
    REQUEST = "req"


def utc_now() -> datetime:
    """The current time in UTC, at the microsecond precision `ce-time` carries."""
    return datetime.now(UTC)


_TRACEPARENT = r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"
HeaderText = Annotated[str, StringConstraints(pattern=r"^[^\x00-\x1f\x7f]*$")]
"""Text that travels in a NATS header: no control characters, so no CR/LF can inject another header."""


class Event(BaseModel):
    """Envelope shared by all event types. Subclasses fix `type`, the data model and the subject."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: ClassVar[Family]
    name: ClassVar[str]
    """The last subject token, e.g. `submitted` in `lanes.job.<job>.submitted`."""

    id: HeaderText = Field(default_factory=new_event_id, min_length=1, max_length=128)
    source: HeaderText = Field(min_length=1, max_length=256)
    type: str
    time: AwareDatetime = Field(default_factory=utc_now)
    subject: HeaderText | None = Field(default=None, max_length=512)
    lane: Lane
    jobid: Token | None = None
    attempt: int | None = Field(default=None, ge=1)
    node: Token | None = None
    rank: int | None = Field(default=None, ge=0)
    causationid: HeaderText | None = Field(default=None, max_length=128)
    correlationid: HeaderText | None = Field(default=None, max_length=128)
    traceparent: str | None = Field(default=None, pattern=_TRACEPARENT)
    data: Any

    @model_validator(mode="after")
    def _has_subject_keys(self) -> Event:
        # The subject is built from these keys, so an event without them could never be routed.
        if self.family is Family.JOB and self.jobid is None:
            msg = f"{self.type} needs jobid: it is published on lanes.job.<jobid>.{self.name}"
            raise ValueError(msg)
        if self.family in {Family.NODE, Family.TELEMETRY} and self.node is None:
            msg = f"{self.type} needs node: it is published on lanes.{self.family}.<node>.{self.name}"
            raise ValueError(msg)
        return self

    @property
    def job_key(self) -> str:
        """The job id of a job-family event (validated present at construction)."""
        if self.jobid is None:
            msg = f"{self.type} carries no job id"
            raise ValueError(msg)
        return self.jobid

    @property
    def node_key(self) -> str:
        """The node id of a node- or telemetry-family event (validated present at construction)."""
        if self.node is None:
            msg = f"{self.type} carries no node id"
            raise ValueError(msg)
        return self.node

    def nats_subject(self) -> str:
        """The subject this event is published on; its tokens are the event's own join keys."""
        key = self.jobid if self.family is Family.JOB else self.node
        return f"lanes.{self.family}.{key}.{self.name}"


_E = TypeVar("_E", bound=Event)


def derive(cls: type[_E], cause: Event, *, key: str = "", **fields: Any) -> _E:
    """Build an event caused by `cause`, with a deterministic id so a handler that runs twice emits it once.

    `key` tells apart several events of the same type caused by one event (e.g. one per rank). The join
    keys of the cause are carried over unless given.
    """
    event_type = cls.model_fields["type"].default
    defaults: dict[str, Any] = {
        "jobid": cause.jobid,
        "attempt": cause.attempt,
        "correlationid": cause.correlationid or cause.id,
        "traceparent": cause.traceparent,
    }
    return cls(
        id=derived_event_id(cause.id, event_type, key, at=cause.time),
        causationid=cause.id,
        **(defaults | fields),
    )


class _Data(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# --- job family: lanes.job.<job_id>.<name> -------------------------------------------------------


class JobSubmittedData(_Data):
    """The submitted spec."""

    spec: JobSpec


class JobSubmitted(Event):
    """A user or client asked for a job to run."""

    family = Family.JOB
    name = "submitted"
    type: Literal["io.lanes.job.submitted.v1"] = "io.lanes.job.submitted.v1"
    lane: Lane = Lane.PLATFORM
    data: JobSubmittedData


class JobWaitingData(_Data):
    """Why a job waits, and where it stands in the queue."""

    reason: str = Field(min_length=1, description="Why the job cannot be placed yet, e.g. capacity_short.")
    detail: str = ""
    queue_position: int | None = Field(default=None, ge=1)
    # --- scheduler: the structured reason (defaults keep older events readable) ---
    owner_lane: Lane | None = Field(default=None, description="The lane that can unblock the job.")
    blocking: tuple[BlockingResource, ...] = Field(default=(), description="What blocks it, and who holds it.")
    figures: dict[str, int] = Field(default_factory=dict, description="The numbers behind the reason.")


class JobWaiting(Event):
    """The scheduler cannot place the job yet, and says why."""

    family = Family.JOB
    name = "waiting"
    type: Literal["io.lanes.job.waiting.v1"] = "io.lanes.job.waiting.v1"
    lane: Lane = Lane.PLATFORM
    data: JobWaitingData


class RankAssignment(_Data):
    """Where one rank runs: its node and the GPU indices it holds there."""

    rank: int = Field(ge=0)
    node: Token
    gpus: tuple[int, ...] = Field(description="GPU indices on the node given to this rank.")


class JobPlacedData(_Data):
    """The placement of every rank of the gang."""

    assignments: tuple[RankAssignment, ...] = Field(min_length=1)
    level: str | None = Field(default=None, description="The topology level holding the whole gang, e.g. leaf.")
    domain: str | None = Field(default=None, description="The domain at that level, e.g. leaf-3.")

    @property
    def nodes(self) -> tuple[str, ...]:
        """The distinct nodes of the placement, in rank order."""
        return tuple(dict.fromkeys(a.node for a in self.assignments))


class JobPlaced(Event):
    """The scheduler admitted the job's gang and placed every rank."""

    family = Family.JOB
    name = "placed"
    type: Literal["io.lanes.job.placed.v1"] = "io.lanes.job.placed.v1"
    lane: Lane = Lane.PLATFORM
    data: JobPlacedData


class RankStartedData(_Data):
    """The started process."""

    pid: int = Field(ge=1)


class RankStarted(Event):
    """A launcher started the process of one rank."""

    family = Family.JOB
    name = "rank_started"
    type: Literal["io.lanes.job.rank_started.v1"] = "io.lanes.job.rank_started.v1"
    lane: Lane = Lane.HOST
    data: RankStartedData


class RankExitedData(_Data):
    """How a rank's process ended."""

    exit_code: int | None = Field(description="Process exit status, or None when killed by a signal.")
    signal: int | None = Field(default=None, ge=1)

    @property
    def succeeded(self) -> bool:
        """Whether the rank exited normally with status 0."""
        return self.exit_code == 0 and self.signal is None


class RankExited(Event):
    """The process of one rank ended, with its exit status or the signal that killed it."""

    family = Family.JOB
    name = "rank_exited"
    type: Literal["io.lanes.job.rank_exited.v1"] = "io.lanes.job.rank_exited.v1"
    lane: Lane = Lane.HOST
    data: RankExitedData


class JobStateChangedData(_Data):
    """A transition of the job's base state."""

    from_state: JobState | None
    to_state: JobState
    cause_type: str = Field(description="The `type` of the event that caused the transition.")
    reason: str = ""
    # --- lifecycle: why an attempt ended, and which transition of the job this is (defaults: older events) ---
    cause: FailureCause | None = Field(default=None, description="Set when the transition ends an attempt.")
    sequence: int | None = Field(default=None, ge=1, description="1 for the job's first transition, then 2, 3...")


class JobStateChanged(Event):
    """The lifecycle service moved a job (and its attempt) to a new state; causationid is the cause."""

    family = Family.JOB
    name = "state_changed"
    type: Literal["io.lanes.job.state_changed.v1"] = "io.lanes.job.state_changed.v1"
    lane: Lane = Lane.PLATFORM
    data: JobStateChangedData


class ResourcesReleasedData(_Data):
    """What the scheduler freed."""

    nodes: tuple[Token, ...]
    gpus: int = Field(ge=0)


class ResourcesReleased(Event):
    """The scheduler freed the allocation of a finished attempt."""

    family = Family.JOB
    name = "resources_released"
    type: Literal["io.lanes.job.resources_released.v1"] = "io.lanes.job.resources_released.v1"
    lane: Lane = Lane.PLATFORM
    data: ResourcesReleasedData


# --- node family: lanes.node.<node_id>.<name> ----------------------------------------------------


class NodeRegisteredData(_Data):
    """A node's GPUs and labels."""

    gpu_model: str = Field(min_length=1)
    gpus: int = Field(ge=0, le=64)
    gpu_memory_gib: int = Field(ge=0)
    labels: dict[str, str] = Field(default_factory=dict)
    # --- scheduler: where the node sits (defaults: alone in every domain, default pool) ---
    nvlink_domain: Token | None = None
    leaf: Token | None = None
    spine: Token | None = None
    rack: Token | None = None
    pool: Token = "default"


class NodeRegistered(Event):
    """A node joined the cluster inventory with its GPUs."""

    family = Family.NODE
    name = "registered"
    type: Literal["io.lanes.node.registered.v1"] = "io.lanes.node.registered.v1"
    lane: Lane = Lane.HOST
    data: NodeRegisteredData


# --- scheduler ---


class BlockingResource(_Data):
    """One thing that keeps a job waiting: a node, a topology domain, a quota, a pool or a reservation."""

    kind: Literal["node", "domain", "quota", "pool", "reservation", "capacity"]
    id: str = Field(min_length=1)
    holders: tuple[str, ...] = Field(default=(), description="Jobs holding GPUs of this resource.")
    free_gpus: int | None = None
    state: str | None = Field(default=None, description="For a node: cordoned, draining or unhealthy.")
    reason: str = ""
    owner_lane: Lane | None = None


JobWaitingData.model_rebuild()


class JobRejectedData(_Data):
    """Why the job can never be placed."""

    reason: str = Field(min_length=1)
    detail: str = ""
    owner_lane: Lane | None = None
    figures: dict[str, int] = Field(default_factory=dict)


class JobRejected(Event):
    """The scheduler will never place this job (e.g. no node can ever satisfy its GPU spec)."""

    family = Family.JOB
    name = "rejected"
    type: Literal["io.lanes.job.rejected.v1"] = "io.lanes.job.rejected.v1"
    lane: Lane = Lane.PLATFORM
    data: JobRejectedData


class NodeStateChangedData(_Data):
    """A node's new state; the event's `lane` is the lane that owns the change (who to ask)."""

    state: NodeState
    reason: str = ""


class NodeStateChanged(Event):
    """A node was cordoned, drained, marked unhealthy, or made ready again."""

    family = Family.NODE
    name = "state_changed"
    type: Literal["io.lanes.node.state_changed.v1"] = "io.lanes.node.state_changed.v1"
    lane: Lane = Lane.PLATFORM
    data: NodeStateChangedData


CLUSTER_POLICY_NODE = "cluster-policy"
"""The node token under which cluster-wide policy travels: `lanes.node.cluster-policy.policy_set`."""


class ClusterPolicySetData(_Data):
    """The pools and tenant quotas that now apply (replaces the previous policy)."""

    policy: ClusterPolicy


class ClusterPolicySet(Event):
    """Pools and tenant GPU quotas were set."""

    family = Family.NODE
    name = "policy_set"
    type: Literal["io.lanes.node.policy_set.v1"] = "io.lanes.node.policy_set.v1"
    lane: Lane = Lane.PLATFORM
    node: Token | None = CLUSTER_POLICY_NODE
    data: ClusterPolicySetData


# --- lifecycle ---


class RendezvousDoneData(_Data):
    """The rank found its peers: the world size it joined."""

    world_size: int = Field(ge=1)


class RendezvousDone(Event):
    """A rank completed rendezvous (it knows its peers); part of `starting`."""

    family = Family.JOB
    name = "rendezvous_done"
    type: Literal["io.lanes.job.rendezvous_done.v1"] = "io.lanes.job.rendezvous_done.v1"
    lane: Lane = Lane.PLATFORM
    data: RendezvousDoneData


class CommunicatorReadyData(_Data):
    """The collective communicator a rank initialised."""

    backend: str = ""


class CommunicatorReady(Event):
    """A rank's communicator (NCCL, gloo...) is initialised; when every rank is, the job is running."""

    family = Family.JOB
    name = "communicator_ready"
    type: Literal["io.lanes.job.communicator_ready.v1"] = "io.lanes.job.communicator_ready.v1"
    lane: Lane = Lane.NETWORK
    data: CommunicatorReadyData


class CheckpointStartedData(_Data):
    """The training step being checkpointed."""

    step: int = Field(ge=0)


class CheckpointStarted(Event):
    """A rank began writing a checkpoint; the job carries the `checkpointing` flag until it is saved."""

    family = Family.JOB
    name = "checkpoint_started"
    type: Literal["io.lanes.job.checkpoint_started.v1"] = "io.lanes.job.checkpoint_started.v1"
    lane: Lane = Lane.ALGORITHM
    data: CheckpointStartedData


class CheckpointSavedData(_Data):
    """A written checkpoint: its step, where it is and its content digest (what makes it verifiable)."""

    step: int = Field(ge=0)
    path: str = Field(min_length=1)
    digest: Digest
    # --- recovery: what the checkpoint was trained with, checked against the spec before a resume ---
    model_version: Digest | None = None
    data_version: Digest | None = None
    config_version: Digest | None = None
    image: str | None = None


class CheckpointSaved(Event):
    """A checkpoint was written and its digest recorded: the attempt's last verified checkpoint."""

    family = Family.JOB
    name = "checkpoint_saved"
    type: Literal["io.lanes.job.checkpoint_saved.v1"] = "io.lanes.job.checkpoint_saved.v1"
    lane: Lane = Lane.ALGORITHM
    data: CheckpointSavedData


class ArtifactProducedData(_Data):
    """An output of the job, named as the spec's success criteria name it."""

    artifact: Token
    path: str = Field(min_length=1)
    digest: Digest | None = None


class ArtifactProduced(Event):
    """A rank produced an artifact (a model export, an eval report...)."""

    family = Family.JOB
    name = "artifact_produced"
    type: Literal["io.lanes.job.artifact_produced.v1"] = "io.lanes.job.artifact_produced.v1"
    lane: Lane = Lane.ALGORITHM
    data: ArtifactProducedData


class HeartbeatData(_Data):
    """Progress of a rank: the step it reached."""

    step: int = Field(ge=0)


class Heartbeat(Event):
    """A rank is alive at a step; the steps past the last verified checkpoint are what a failure loses."""

    family = Family.JOB
    name = "heartbeat"
    type: Literal["io.lanes.job.heartbeat.v1"] = "io.lanes.job.heartbeat.v1"
    lane: Lane = Lane.ALGORITHM
    data: HeartbeatData


class CommandData(_Data):
    """Who asked, and why."""

    reason: str = ""
    requested_by: str = ""


class CancelRequested(Event):
    """A user asked to cancel the job (its current attempt)."""

    family = Family.JOB
    name = "cancel_requested"
    type: Literal["io.lanes.job.cancel_requested.v1"] = "io.lanes.job.cancel_requested.v1"
    lane: Lane = Lane.ALGORITHM
    data: CommandData


class RetryData(CommandData):
    """A retry, optionally pinned to the verified checkpoint step it must resume from."""

    resume_step: int | None = Field(
        default=None, ge=0, description="The step of the verified checkpoint; unset: the latest saved one."
    )
    avoid_nodes: tuple[Token, ...] = Field(
        default=(), description="Nodes the new attempt must not be placed on, e.g. the ones recovery cordoned."
    )


class RetryRequested(Event):
    """A user asked for a new attempt; `attempt` names the attempt being retried (a stale one is rejected)."""

    family = Family.JOB
    name = "retry_requested"
    type: Literal["io.lanes.job.retry_requested.v1"] = "io.lanes.job.retry_requested.v1"
    lane: Lane = Lane.ALGORITHM
    data: RetryData


class HoldRequestedData(CommandData):
    """Who owns the manual decision, and by when."""

    owner: str = ""
    deadline: AwareDatetime | None = None


class HoldRequested(Event):
    """Put a finished-but-not-succeeded job on the manual path: no retry until an owner resumes it."""

    family = Family.JOB
    name = "hold_requested"
    type: Literal["io.lanes.job.hold_requested.v1"] = "io.lanes.job.hold_requested.v1"
    lane: Lane = Lane.PLATFORM
    data: HoldRequestedData


class ResumeRequested(Event):
    """The owner of a held job decided: start a new attempt (from `resume_step` when it is pinned)."""

    family = Family.JOB
    name = "resume_requested"
    type: Literal["io.lanes.job.resume_requested.v1"] = "io.lanes.job.resume_requested.v1"
    lane: Lane = Lane.PLATFORM
    data: RetryData


class AttemptRequestedData(_Data):
    """Why a new attempt is wanted, and the step to resume from (the last verified checkpoint)."""

    reason: str
    resume_step: int | None = None
    avoid_nodes: tuple[Token, ...] = Field(
        default=(), description="Nodes the scheduler must never place this attempt on (carried from the retry)."
    )


class AttemptRequested(Event):
    """The lifecycle created attempt `attempt` of the job; the scheduler queues it for placement."""

    family = Family.JOB
    name = "attempt_requested"
    type: Literal["io.lanes.job.attempt_requested.v1"] = "io.lanes.job.attempt_requested.v1"
    lane: Lane = Lane.PLATFORM
    data: AttemptRequestedData


class TransitionRejectedData(_Data):
    """An event the job's state did not allow, kept on the timeline instead of silently dropped."""

    event_type: str
    event_id: str
    state: JobState | None
    reason: str


class TransitionRejected(Event):
    """The lifecycle refused an event for this job; the projection was left as it was."""

    family = Family.JOB
    name = "transition_rejected"
    type: Literal["io.lanes.job.transition_rejected.v1"] = "io.lanes.job.transition_rejected.v1"
    lane: Lane = Lane.PLATFORM
    data: TransitionRejectedData


# --- telemetry ---


class EvidenceCategory(StrEnum):
    """What one piece of evidence says happened; the election separates causes from consequences by it."""

    # communication (lanes.tel.<node>.comm)
    COLLECTIVE_TIMEOUT = "collective_timeout"
    COMM_INIT_FAILURE = "comm_init_failure"
    PEER_CLOSED = "peer_closed"
    COMM_ERROR = "comm_error"
    # process (lanes.tel.<node>.process)
    PROCESS_STARTED = "process_started"
    PROCESS_EXITED = "process_exited"
    PYTHON_EXCEPTION = "python_exception"
    CUDA_OOM = "cuda_oom"
    CUDA_ERROR = "cuda_error"
    # host (lanes.tel.<node>.host)
    OOM_KILL = "oom_kill"
    GPU_XID = "gpu_xid"
    ECC_ERROR = "ecc_error"
    DISK_FULL = "disk_full"
    CLOCK_OFFSET = "clock_offset"
    # network (lanes.tel.<node>.network)
    LINK_DOWN = "link_down"
    LINK_UP = "link_up"
    LINK_FLAP = "link_flap"
    PORT_ERRORS = "port_errors"
    RETRY_EXCEEDED = "retry_exceeded"
    # platform (lanes.tel.<node>.platform)
    PREEMPTION = "preemption"
    CONFIG_MISMATCH = "config_mismatch"
    # anything a parser did not recognise (lanes.tel.<node>.raw)
    RAW = "raw"
    # added later; kept at the end so older values keep their place
    RENDEZVOUS_FAILURE = "rendezvous_failure"
    """The c10d store / rendezvous could not be reached or started (platform)."""
    RESOURCE_EXHAUSTED = "resource_exhausted"
    """A limit of the platform: /dev/shm too small, devices still held by an earlier job, file descriptors."""
    COLLECTIVE_MISMATCH = "collective_mismatch"
    """Ranks called different collectives, or the same one with different sizes (the job's code)."""
    NUMERIC_ANOMALY = "numeric_anomaly"
    """NaN / Inf in the loss or the gradients (the job's code or data)."""
    CONNECT_FAILED = "connect_failed"
    """A rank could not open a connection to a peer (NCCL socket / proxy connect): the first failing side."""
    NODE_LOST = "node_lost"
    """The scheduler lost a node (Slurm `Node failure`)."""


class EvidenceData(_Data):
    """One piece of evidence: its category, the raw line(s) it came from and the fields parsed out of them."""

    category: EvidenceCategory
    summary: str = Field(default="", max_length=1024)
    lines: tuple[str, ...] = Field(default=(), description="The raw log line or lines, as written by the producer.")
    origin: str = Field(default="", max_length=256, description="Where the lines came from: a file, a log stream.")
    op_type: str | None = Field(default=None, description="Collective operation, e.g. ALLREDUCE.")
    seq_num: int | None = Field(default=None, ge=0, description="Collective sequence number (SeqNum).")
    timeout_ms: int | None = Field(default=None, ge=0)
    last_enqueued: int | None = Field(default=None, ge=0, description="Last enqueued collective SeqNum.")
    last_completed: int | None = Field(default=None, ge=0, description="Last completed collective SeqNum.")
    peer: str | None = Field(default=None, description="The peer named by a socket or IB error (host or address).")
    interface: str | None = Field(default=None, description="NIC or port, e.g. ibp94s0 or mlx5_0:1.")
    pid: int | None = Field(default=None, ge=0)
    exit_code: int | None = None
    signal: int | None = Field(default=None, ge=1)
    xid: int | None = Field(default=None, ge=0)
    gpu: str | None = Field(default=None, description="GPU index or PCI address.")
    offset_ms: float | None = Field(default=None, description="Clock offset of the node against the reference.")
    error_type: str | None = Field(default=None, description="Exception class, e.g. torch.OutOfMemoryError.")


class _Evidence(Event):
    family = Family.TELEMETRY
    data: EvidenceData


class CommunicationEvidence(_Evidence):
    """Collective timeouts, communicator init failures, socket or IB errors naming a peer."""

    name = "comm"
    type: Literal["io.lanes.tel.comm.v1"] = "io.lanes.tel.comm.v1"
    lane: Lane = Lane.NETWORK


class ProcessEvidence(_Evidence):
    """A rank's process started, exited (code or signal), or raised (traceback summary, CUDA error)."""

    name = "process"
    type: Literal["io.lanes.tel.process.v1"] = "io.lanes.tel.process.v1"
    lane: Lane = Lane.ALGORITHM


class HostEvidence(_Evidence):
    """OOM kill, GPU Xid, ECC, disk full, clock offset."""

    name = "host"
    type: Literal["io.lanes.tel.host.v1"] = "io.lanes.tel.host.v1"
    lane: Lane = Lane.HOST


class NetworkEvidence(_Evidence):
    """Link down / up / flap, port error counters, retry exceeded."""

    name = "network"
    type: Literal["io.lanes.tel.network.v1"] = "io.lanes.tel.network.v1"
    lane: Lane = Lane.NETWORK


class PlatformEvidence(_Evidence):
    """Preemption, configuration or version mismatch."""

    name = "platform"
    type: Literal["io.lanes.tel.platform.v1"] = "io.lanes.tel.platform.v1"
    lane: Lane = Lane.PLATFORM


class RawEvidence(_Evidence):
    """A line no parser recognised, kept so nothing a producer sent is lost."""

    name = "raw"
    type: Literal["io.lanes.tel.raw.v1"] = "io.lanes.tel.raw.v1"
    lane: Lane = Lane.PLATFORM


class JobEvidenceData(_Data):
    """A compact copy of telemetry evidence, correlated to the job: the job timeline holds every team's evidence."""

    evidence_id: str = Field(min_length=1, max_length=128)
    evidence: EvidenceData


class JobEvidence(Event):
    """Telemetry evidence correlated (by node and time) to the job, attempt and rank placed there."""

    family = Family.JOB
    name = "evidence"
    type: Literal["io.lanes.job.evidence.v1"] = "io.lanes.job.evidence.v1"
    lane: Lane = Lane.HOST
    data: JobEvidenceData


class FindingCause(_Data):
    """The elected first error: where, when, which lane, and the evidence chain that shows it."""

    category: str = Field(min_length=1)
    lane: Lane
    node: str | None = None
    rank: int | None = Field(default=None, ge=0)
    time: AwareDatetime | None = None
    summary: str = ""
    evidence: tuple[str, ...] = Field(default=(), description="The raw line or lines, first error first.")


class ConsequenceGroup(_Data):
    """Many ranks reporting the same consequence, e.g. 255 ranks timed out in ALLREDUCE SeqNum=1580."""

    category: str
    summary: str
    count: int = Field(ge=1)
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()


class MissingEvidence(_Data):
    """Evidence a lane still has to provide ("pending evidence")."""

    lane: Lane
    what: str
    node: str | None = None
    rank: int | None = None


class JobFindingData(_Data):
    """The result of the first-error election for one attempt; a later version supersedes an earlier one."""

    version: int = Field(ge=1)
    first_error: FindingCause | None
    consequences: tuple[ConsequenceGroup, ...] = ()
    stage: str
    missing_evidence: tuple[MissingEvidence, ...] = ()
    confidence: float = Field(ge=0.0, le=1.0)
    owner: str = Field(default="", description="Who to call next.")
    evidence_count: int = Field(default=0, ge=0)


class JobFinding(Event):
    """Telemetry's first-error finding for the job (its attempt); `lane` is the lane of the first error."""

    family = Family.JOB
    name = "finding"
    type: Literal["io.lanes.job.finding.v1"] = "io.lanes.job.finding.v1"
    lane: Lane = Lane.PLATFORM
    data: JobFindingData


# --- router ---


class ReplicaState(StrEnum):
    """Where an inference replica stands in the router's rotation."""

    STARTING = "starting"
    """Placed (and maybe listening) but not yet confirmed by a health check."""
    READY = "ready"
    DRAINING = "draining"
    """Takes no new requests; the ones in flight finish."""
    UNHEALTHY = "unhealthy"
    """In the penalty box (or marked by recovery); probed until it answers again."""
    GONE = "gone"
    """Its attempt ended; it will never take a request again."""


class ReplicaListeningData(_Data):
    """The address a replica's server answers on, as its process announced it."""

    endpoint: str = Field(
        pattern=r"^https?://[^\s/]+$", description="Scheme, host and port, e.g. http://10.0.0.7:8000."
    )
    rank: int = Field(default=0, ge=0)


class ReplicaListening(Event):
    """A launcher saw an inference replica's server start listening."""

    family = Family.JOB
    name = "replica_listening"
    type: Literal["io.lanes.job.replica_listening.v1"] = "io.lanes.job.replica_listening.v1"
    lane: Lane = Lane.HOST
    data: ReplicaListeningData


class ReplicaStateChangedData(_Data):
    """A replica (one inference job) entered a new state in the router's rotation."""

    replica: Token
    model: Token
    version: Token
    state: ReplicaState
    previous: ReplicaState | None = None
    reason: str = ""
    signal: Literal["placement", "probe", "passive", "recovery", "operator", "lifecycle"] = "probe"
    endpoint: str | None = None
    gpus: tuple[int, ...] = ()
    penalty_s: float | None = Field(default=None, ge=0, description="How long it stays out before the next probe.")


class ReplicaStateChanged(Event):
    """A replica became ready, draining, unhealthy or gone; routers fold these into their registry."""

    family = Family.JOB
    name = "replica_state"
    type: Literal["io.lanes.job.replica_state.v1"] = "io.lanes.job.replica_state.v1"
    lane: Lane = Lane.PLATFORM
    data: ReplicaStateChangedData


UNROUTED = "unrouted"
"""The replica token of a request no replica took: `lanes.req.<model>.unrouted`."""


class RequestAttempt(_Data):
    """One try of a request on one replica, and why the router moved on (or stopped)."""

    replica: Token
    node: str | None = None
    outcome: Literal["ok", "error", "timeout", "refused", "slow_first_token", "failed_mid_stream", "client_closed"]
    detail: str = ""
    http_status: int | None = None
    elapsed_ms: float = Field(ge=0)


class RequestServedData(_Data):
    """The provenance of one inference request: who served it, on what, how it went, and every try."""

    request_id: HeaderText = Field(min_length=1, max_length=128)
    model: Token
    version: Token | None = None
    replica: Token = Field(description="The replica that answered, or `unrouted`.")
    gpus: tuple[int, ...] = ()
    endpoint: str | None = None
    route: str = Field(description="The API path, e.g. /v1/chat/completions.")
    stream: bool = False
    status: Literal["ok", "failed", "rejected", "client_closed"]
    http_status: int
    error: str = ""
    attempts: tuple[RequestAttempt, ...] = ()
    received_at: AwareDatetime
    ttft_ms: float | None = Field(default=None, ge=0, description="Time to the first byte of the answer.")
    latency_ms: float = Field(ge=0)
    prompt_tokens: int | None = Field(default=None, ge=0)
    completion_tokens: int | None = Field(default=None, ge=0)
    router: str = Field(default="", description="Which router process handled it.")


class RequestServed(Event):
    """One inference request, end to end; `jobid`/`node` are the serving replica's job and node."""

    family = Family.REQUEST
    name = "served"
    type: Literal["io.lanes.req.served.v1"] = "io.lanes.req.served.v1"
    lane: Lane = Lane.PLATFORM
    data: RequestServedData

    def nats_subject(self) -> str:
        """`lanes.req.<model>.<replica>`: the join keys of a request are its model and replica."""
        return f"lanes.req.{self.data.model}.{self.data.replica}"


# --- recovery ---


class RecoveryAction(StrEnum):
    """What the recovery service decided to do about a failed attempt."""

    RESUME = "resume"
    """Training: a new attempt from the last verified checkpoint, on healthy nodes."""
    REBUILD = "rebuild"
    """Evaluation / batch: a new attempt from the start."""
    REPLACE_REPLICA = "replace_replica"
    """Inference: the replica leaves rotation and a replacement of the same version is placed."""
    MANUAL = "manual"
    """No automatic recovery: the job waits for its owner (`lanes recover`)."""
    NONE = "none"
    """Nothing to recover (e.g. the attempt succeeded or was cancelled by its user)."""
    ABANDON = "abandon"
    """The owner gave up on the job (`lanes recover --abandon`): it ends cancelled, with its failure kept."""


class ManualAction(StrEnum):
    """What an owner decided for a job waiting on the manual path."""

    APPROVE = "approve"
    """Run the recovery the policy would have run (e.g. resume from the verified checkpoint)."""
    ROLLBACK = "rollback"
    """Resume from the checkpoint before the last verified one (e.g. the last one is suspect)."""
    ABANDON = "abandon"
    """Give up on the job."""


class CheckpointRef(_Data):
    """A checkpoint as its `checkpoint_saved` event recorded it."""

    attempt: int = Field(ge=1)
    step: int = Field(ge=0)
    path: str
    digest: str


class RefusedCheckpoint(_Data):
    """A checkpoint the version gate refused, and the field that did not match."""

    checkpoint: CheckpointRef
    field: str = Field(description="digest, step, model_version, data_version, config_version or image.")
    expected: str | None = None
    found: str | None = None


class LostWork(_Data):
    """The work a failure threw away: steps past the resumed checkpoint, times GPUs, times step time."""

    steps: int = Field(ge=0)
    gpus: int = Field(ge=0)
    step_time_s: float | None = Field(default=None, ge=0)
    gpu_hours: float | None = Field(default=None, ge=0)


class RecoveryDecidedData(_Data):
    """One recovery decision: what it acted on, under which policy, what it does, and what should follow."""

    finding_id: str = Field(min_length=1, description="The finding (or event) the decision acted on.")
    finding_version: int | None = Field(default=None, ge=1)
    first_error: str = Field(default="", description="lane/category of the first error, e.g. host/oom_killed.")
    policy: str = Field(min_length=1)
    policy_version: int = Field(ge=1)
    workload_class: str
    action: RecoveryAction
    reason: str
    owner: str = Field(description="Who owns the next step (person or team, else the lane's on-call).")
    owner_lane: Lane
    rollback: str = Field(description="How to undo this decision.")
    expects: str = Field(description="The event type that should follow if all goes well.")
    cordon: tuple[Token, ...] = Field(default=(), description="Nodes taken out of scheduling.")
    checkpoint: CheckpointRef | None = None
    refused: tuple[RefusedCheckpoint, ...] = ()
    lost_work: LostWork | None = None
    backoff_s: float | None = Field(default=None, ge=0)
    deadline: AwareDatetime | None = None
    retries_used: int = Field(default=0, ge=0)
    # --- manual path and inference (defaults: a decision the policy made on its own) ---
    manual_action: ManualAction | None = Field(default=None, description="Set when an owner's action decided.")
    requested_by: str = Field(default="", description="Who took the manual action; empty when the policy decided.")
    protection: ProtectionMode | None = Field(
        default=None, description="Inference: how the router protects requests while the replica is replaced."
    )
    resume_step: int | None = Field(
        default=None, ge=0, description="The step the next attempt starts from (0: the start)."
    )


class RecoveryDecided(Event):
    """The recovery service decided how the job's failed attempt recovers (or that it waits for a person)."""

    family = Family.JOB
    name = "recovery_decided"
    type: Literal["io.lanes.job.recovery_decided.v1"] = "io.lanes.job.recovery_decided.v1"
    lane: Lane = Lane.PLATFORM
    data: RecoveryDecidedData


class RecoveryEscalatedData(_Data):
    """A manual step whose deadline passed without a decision."""

    decision_id: str
    owner: str
    owner_lane: Lane
    deadline: AwareDatetime
    reason: str = ""


class RecoveryEscalated(Event):
    """Nobody acted on a manual recovery step before its deadline."""

    family = Family.JOB
    name = "recovery_escalated"
    type: Literal["io.lanes.job.recovery_escalated.v1"] = "io.lanes.job.recovery_escalated.v1"
    lane: Lane = Lane.PLATFORM
    data: RecoveryEscalatedData


class ManualActionData(CommandData):
    """The owner's decision; `requested_by` and `reason` say who and why."""

    action: ManualAction


class ManualActionRequested(Event):
    """An owner acted on a job waiting for a manual recovery decision (`lanes recover`)."""

    family = Family.JOB
    name = "manual_action"
    type: Literal["io.lanes.job.manual_action.v1"] = "io.lanes.job.manual_action.v1"
    lane: Lane = Lane.PLATFORM
    data: ManualActionData


AnyEvent = Annotated[
    JobSubmitted
    | JobWaiting
    | JobPlaced
    | RankStarted
    | RankExited
    | JobStateChanged
    | ResourcesReleased
    | NodeRegistered
    | JobRejected
    | NodeStateChanged
    | ClusterPolicySet
    | RendezvousDone
    | CommunicatorReady
    | CheckpointStarted
    | CheckpointSaved
    | ArtifactProduced
    | Heartbeat
    | CancelRequested
    | RetryRequested
    | HoldRequested
    | ResumeRequested
    | AttemptRequested
    | TransitionRejected
    | CommunicationEvidence
    | ProcessEvidence
    | HostEvidence
    | NetworkEvidence
    | PlatformEvidence
    | RawEvidence
    | JobEvidence
    | JobFinding
    | ReplicaListening
    | ReplicaStateChanged
    | RequestServed
    | RecoveryDecided
    | RecoveryEscalated
    | ManualActionRequested,
    Field(discriminator="type"),
]
"""Every event type Lanes knows, discriminated by `type`."""

EVENT_TYPES: dict[str, type[Event]] = {cls.model_fields["type"].default: cls for cls in get_args(get_args(AnyEvent)[0])}
"""Event class by its `type`, derived from `AnyEvent` so the catalogue is written down once."""
