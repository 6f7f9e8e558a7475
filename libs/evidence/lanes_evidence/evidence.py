"""Evidence as the election sees it: the catalogue's evidence data plus where and when it was observed."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from lanes_contract.events import (
    CommunicationEvidence,
    Event,
    EvidenceCategory,
    EvidenceData,
    HostEvidence,
    JobEvidence,
    Lane,
    NetworkEvidence,
    PlatformEvidence,
    ProcessEvidence,
    RawEvidence,
)

_EvidenceEvent = (
    CommunicationEvidence | ProcessEvidence | HostEvidence | NetworkEvidence | PlatformEvidence | RawEvidence
)

C = EvidenceCategory

KIND_OF_CATEGORY: dict[EvidenceCategory, str] = {
    C.COLLECTIVE_TIMEOUT: "comm",
    C.COMM_INIT_FAILURE: "comm",
    C.PEER_CLOSED: "comm",
    C.COMM_ERROR: "comm",
    C.PROCESS_STARTED: "process",
    C.PROCESS_EXITED: "process",
    C.PYTHON_EXCEPTION: "process",
    C.CUDA_OOM: "process",
    C.CUDA_ERROR: "process",
    C.OOM_KILL: "host",
    C.GPU_XID: "host",
    C.ECC_ERROR: "host",
    C.DISK_FULL: "host",
    C.CLOCK_OFFSET: "host",
    C.LINK_DOWN: "network",
    C.LINK_UP: "network",
    C.LINK_FLAP: "network",
    C.PORT_ERRORS: "network",
    C.RETRY_EXCEEDED: "network",
    C.PREEMPTION: "platform",
    C.CONFIG_MISMATCH: "platform",
    C.RAW: "raw",
    C.RENDEZVOUS_FAILURE: "platform",
    C.RESOURCE_EXHAUSTED: "platform",
    C.COLLECTIVE_MISMATCH: "comm",
    C.NUMERIC_ANOMALY: "process",
    C.CONNECT_FAILED: "comm",
    C.NODE_LOST: "host",
    C.AGENT_FAULT: "platform",
}
"""The subject token (`lanes.tel.<node>.<kind>`) each category travels under."""

LANE_OF_CATEGORY: dict[EvidenceCategory, Lane] = {
    C.COLLECTIVE_TIMEOUT: Lane.NETWORK,
    C.COMM_INIT_FAILURE: Lane.NETWORK,
    C.PEER_CLOSED: Lane.NETWORK,
    C.COMM_ERROR: Lane.NETWORK,
    C.PROCESS_STARTED: Lane.HOST,
    C.PROCESS_EXITED: Lane.HOST,
    # A Python exception, a CUDA OOM or an illegal memory access is the model's code or its inputs,
    # unless a hardware fault (Xid, ECC) on the same node explains it: the election decides that.
    C.PYTHON_EXCEPTION: Lane.ALGORITHM,
    C.CUDA_OOM: Lane.ALGORITHM,
    C.CUDA_ERROR: Lane.ALGORITHM,
    C.OOM_KILL: Lane.HOST,
    C.GPU_XID: Lane.HOST,
    C.ECC_ERROR: Lane.HOST,
    C.DISK_FULL: Lane.HOST,
    C.CLOCK_OFFSET: Lane.HOST,
    C.LINK_DOWN: Lane.NETWORK,
    C.LINK_UP: Lane.NETWORK,
    C.LINK_FLAP: Lane.NETWORK,
    C.PORT_ERRORS: Lane.NETWORK,
    C.RETRY_EXCEEDED: Lane.NETWORK,
    C.PREEMPTION: Lane.PLATFORM,
    C.CONFIG_MISMATCH: Lane.PLATFORM,
    C.RAW: Lane.PLATFORM,
    C.RENDEZVOUS_FAILURE: Lane.PLATFORM,
    C.RESOURCE_EXHAUSTED: Lane.PLATFORM,
    C.COLLECTIVE_MISMATCH: Lane.ALGORITHM,
    C.NUMERIC_ANOMALY: Lane.ALGORITHM,
    C.CONNECT_FAILED: Lane.NETWORK,
    C.NODE_LOST: Lane.HOST,
    C.AGENT_FAULT: Lane.PLATFORM,
}


DRIVER_MODULE_MISMATCH = (
    "the node's NVIDIA driver libraries and its loaded kernel module differ (driver upgraded, not reloaded)"
)
"""NVML's `Driver/library version mismatch` and the kernel's `NVRM: API mismatch` (see parsers.py)."""
HOST_SIDE_SUMMARIES = frozenset({DRIVER_MODULE_MISMATCH})
"""Summaries of evidence whose category's usual lane is wrong for it: a version mismatch is the platform's (an
image built for another driver) unless the host's own driver install disagrees with itself, which the host
team fixes by reloading the module or rebooting."""


def lane_of(data: EvidenceData) -> Lane:
    """The lane of one piece of evidence: its category's, unless what it says moves it (see HOST_SIDE_SUMMARIES)."""
    if data.summary in HOST_SIDE_SUMMARIES:
        return Lane.HOST
    return LANE_OF_CATEGORY[data.category]


@dataclass(frozen=True, slots=True)
class Evidence:
    """One observation: what (data), when (time as the producer's clock said), where (node, rank)."""

    data: EvidenceData
    time: datetime | None = None
    node: str | None = None
    rank: int | None = None
    id: str = ""

    @property
    def category(self) -> EvidenceCategory:
        """The evidence's category."""
        return self.data.category

    @property
    def kind(self) -> str:
        """The subject token of this evidence's category."""
        return KIND_OF_CATEGORY[self.data.category]


EVENT_OF_KIND: dict[str, type[_EvidenceEvent]] = {
    "comm": CommunicationEvidence,
    "process": ProcessEvidence,
    "host": HostEvidence,
    "network": NetworkEvidence,
    "platform": PlatformEvidence,
    "raw": RawEvidence,
}


def evidence_event(evidence: Evidence, *, source: str, node: str, time: datetime) -> _EvidenceEvent:
    """The telemetry event (`lanes.tel.<node>.<kind>`) that carries this evidence.

    `node` and `time` fill in what the evidence does not say itself (a line without a host or a timestamp).
    """
    cls = EVENT_OF_KIND[evidence.kind]
    return cls(
        source=source,
        node=evidence.node or node,
        rank=evidence.rank,
        time=evidence.time or time,
        lane=lane_of(evidence.data),
        data=evidence.data,
    )


def from_event(event: Event) -> Evidence:
    """The evidence a telemetry event (or a job's correlated copy) carries."""
    data = event.data.evidence if isinstance(event, JobEvidence) else event.data
    if not isinstance(data, EvidenceData):
        msg = f"{event.type} carries no evidence"
        raise TypeError(msg)
    return Evidence(data=data, time=event.time, node=event.node, rank=event.rank, id=event.id)
