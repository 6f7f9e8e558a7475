"""Evidence from nodes and ranks (`lanes.tel.<node>.<kind>`), its copy on the job, and findings."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import AwareDatetime, Field

from lanes_contract.events.base import Data, Event, Family, Lane


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
    AGENT_FAULT = "agent_fault"
    """The node agent could not start a rank, or lost one when it restarted (the platform's own fault)."""


class EvidenceData(Data):
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
    lane: Lane = Lane.NETWORK


class ProcessEvidence(_Evidence):
    """A rank's process started, exited (code or signal), or raised (traceback summary, CUDA error)."""

    name = "process"
    lane: Lane = Lane.ALGORITHM


class HostEvidence(_Evidence):
    """OOM kill, GPU Xid, ECC, disk full, clock offset."""

    name = "host"
    lane: Lane = Lane.HOST


class NetworkEvidence(_Evidence):
    """Link down / up / flap, port error counters, retry exceeded."""

    name = "network"
    lane: Lane = Lane.NETWORK


class PlatformEvidence(_Evidence):
    """Preemption, configuration or version mismatch."""

    name = "platform"
    lane: Lane = Lane.PLATFORM


class RawEvidence(_Evidence):
    """A line no parser recognised, kept so nothing a producer sent is lost."""

    name = "raw"
    lane: Lane = Lane.PLATFORM


class JobEvidenceData(Data):
    """A compact copy of telemetry evidence, correlated to the job: the job timeline holds every team's evidence."""

    evidence_id: str = Field(min_length=1, max_length=128)
    evidence: EvidenceData
    shared: bool = Field(
        default=False,
        description="Node-level evidence that names no pid, on a node several jobs shared: filed under each of "
        "them, and never a first error on its own.",
    )
    last_copy_of_category: bool = Field(
        default=False,
        description="The last consequence of its category copied to this attempt's timeline: telemetry copies "
        "every possible cause, but only the first few consequences (timeouts, aborts) of each category per "
        "attempt. The finding's consequence groups count all of them; each stays on the telemetry stream.",
    )


class JobEvidence(Event):
    """Telemetry evidence correlated (by node and time) to the job, attempt and rank placed there."""

    family = Family.JOB
    name = "evidence"
    lane: Lane = Lane.HOST
    data: JobEvidenceData


class FindingCause(Data):
    """The elected first error: where, when, which lane, and the evidence chain that shows it."""

    category: str = Field(min_length=1)
    lane: Lane
    node: str | None = None
    rank: int | None = Field(default=None, ge=0)
    time: AwareDatetime | None = None
    summary: str = ""
    evidence: tuple[str, ...] = Field(default=(), description="The raw line or lines, first error first.")


class ConsequenceGroup(Data):
    """Many ranks reporting the same consequence, e.g. 255 ranks timed out in ALLREDUCE SeqNum=1580."""

    category: str
    summary: str
    count: int = Field(ge=1)
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()


class MissingEvidence(Data):
    """Evidence a lane still has to provide ("pending evidence")."""

    lane: Lane
    what: str
    node: str | None = None
    rank: int | None = None


class JobFindingData(Data):
    """The result of the first-error election for one attempt; a later version supersedes an earlier one."""

    version: int = Field(ge=1)
    first_error: FindingCause | None
    consequences: tuple[ConsequenceGroup, ...] = ()
    stage: str
    missing_evidence: tuple[MissingEvidence, ...] = ()
    confidence: float = Field(ge=0.0, le=1.0)
    owner: str = Field(default="", description="Who to call next.")
    evidence_count: int = Field(default=0, ge=0)
    # --- settlement (defaults: findings written before telemetry said whether they were settled) ---
    settled: bool = Field(
        default=False,
        description="Every rank and node of the attempt is accounted for, or the settle window ended: act on it.",
    )
    settle_reason: str = Field(default="", description="Why the finding is settled, or why not yet.")
    waiting_for: tuple[str, ...] = Field(
        default=(), description="What an unsettled finding still waits for: a kernel log, a silent node, rank exits."
    )


class JobFinding(Event):
    """Telemetry's first-error finding for the job (its attempt); `lane` is the lane of the first error."""

    family = Family.JOB
    name = "finding"
    lane: Lane = Lane.PLATFORM
    data: JobFindingData


class JobSlowdownData(Data):
    """A running attempt is slower than its own start, or one rank holds the others back; nothing failed."""

    kind: Literal["compute_straggler", "degraded_link", "imbalance"]
    rank: int | None = Field(default=None, ge=0, description="The rank holding the others back, if one does.")
    node: str | None = Field(default=None, max_length=256, description="Its node, or the node behind the link.")
    onset_step: int = Field(ge=0, description="The step the slowdown began at (imbalance: the first step).")
    slowdown: float = Field(ge=0, allow_inf_nan=False, description="Relative step-time increase (0.38: +38%).")
    lost_s: float = Field(ge=0, allow_inf_nan=False, description="Seconds lost against the attempt's own baseline.")
    gpu_hours: float = Field(ge=0, allow_inf_nan=False, description="GPU-hours those seconds held.")
    votes: float = Field(
        default=0.0, ge=0, le=1, description="Share of collectives since the onset the rank arrived last at."
    )
    summary: str = Field(max_length=512)


class JobSlowdown(Event):
    """Telemetry found a slow rank or a degraded link in a running attempt (`lane` says whose it is)."""

    family = Family.JOB
    name = "slowdown"
    lane: Lane = Lane.HOST
    data: JobSlowdownData


class SettleWindowEndedData(Data):
    """The end of an attempt's settle window: its finding is settled now, whatever still had not reported."""

    ended_at: AwareDatetime = Field(description="When the attempt ended (the window runs from there).")
    window_s: float = Field(ge=0)


class SettleWindowEnded(Event):
    """Telemetry's timer: the settle window of a failed attempt ran out (its finding settles on what arrived)."""

    family = Family.JOB
    name = "settle_window_ended"
    lane: Lane = Lane.PLATFORM
    data: SettleWindowEndedData
