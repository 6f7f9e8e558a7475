"""The one event catalogue: a frozen pydantic model per event type, discriminated by `type`.

One module per family of events, commands apart. This package exports them all, the union `AnyEvent` and
`EVENT_TYPES`, so a producer imports `lanes_contract.events` and nothing else.
"""

from __future__ import annotations

from typing import Annotated, get_args

from pydantic import Field

from lanes_contract.events.agents import AgentHeartbeat, AgentHeartbeatData, GpuDevice, NodeInventory
from lanes_contract.events.base import Data, Event, Family, HeaderText, Lane, derive, utc_now
from lanes_contract.events.commands import (
    CancelRequested,
    CommandData,
    DrillInjected,
    DrillInjectedData,
    DrillKind,
    HoldRequested,
    HoldRequestedData,
    ResumeRequested,
    RetryData,
    RetryRequested,
)
from lanes_contract.events.job import (
    BlockingResource,
    JobPlaced,
    JobPlacedData,
    JobStateChanged,
    JobStateChangedData,
    JobSubmitted,
    JobSubmittedData,
    JobWaiting,
    JobWaitingData,
    RankAssignment,
    RankExited,
    RankExitedData,
    RankStarted,
    RankStartedData,
    ResourcesReleased,
    ResourcesReleasedData,
)
from lanes_contract.events.progress import (
    ArtifactProduced,
    ArtifactProducedData,
    AttemptRequested,
    AttemptRequestedData,
    CheckpointSaved,
    CheckpointSavedData,
    CheckpointStarted,
    CheckpointStartedData,
    CommunicatorReady,
    CommunicatorReadyData,
    Heartbeat,
    HeartbeatData,
    RendezvousDone,
    RendezvousDoneData,
    StepTiming,
    TransitionRejected,
    TransitionRejectedData,
)
from lanes_contract.events.recovery import (
    CheckpointRef,
    Culprit,
    LostWork,
    ManualAction,
    ManualActionData,
    ManualActionRequested,
    RecoveryAction,
    RecoveryDecided,
    RecoveryDecidedData,
    RecoveryEscalated,
    RecoveryEscalatedData,
    RecoverySuperseded,
    RecoverySupersededData,
    RefusedCheckpoint,
)
from lanes_contract.events.scheduling import (
    CLUSTER_POLICY_NODE,
    ClusterPolicySet,
    ClusterPolicySetData,
    JobRejected,
    JobRejectedData,
    NodeRegistered,
    NodeRegisteredData,
    NodeStateChanged,
    NodeStateChangedData,
)
from lanes_contract.events.serving import (
    UNROUTED,
    ReplicaListening,
    ReplicaListeningData,
    ReplicaState,
    ReplicaStateChanged,
    ReplicaStateChangedData,
    RequestAttempt,
    RequestServed,
    RequestServedData,
)
from lanes_contract.events.telemetry import (
    CommunicationEvidence,
    ConsequenceGroup,
    EvidenceCategory,
    EvidenceData,
    FindingCause,
    HostEvidence,
    JobEvidence,
    JobEvidenceData,
    JobFinding,
    JobFindingData,
    JobSlowdown,
    JobSlowdownData,
    MissingEvidence,
    NetworkEvidence,
    PlatformEvidence,
    ProcessEvidence,
    RawEvidence,
    SettleWindowEnded,
    SettleWindowEndedData,
)

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
    | JobSlowdown
    | SettleWindowEnded
    | ReplicaListening
    | ReplicaStateChanged
    | RequestServed
    | RecoveryDecided
    | RecoveryEscalated
    | RecoverySuperseded
    | ManualActionRequested
    | DrillInjected
    | AgentHeartbeat,
    Field(discriminator="type"),
]
"""Every event type Lanes knows, discriminated by `type`."""

EVENT_TYPES: dict[str, type[Event]] = {cls.model_fields["type"].default: cls for cls in get_args(get_args(AnyEvent)[0])}
"""Event class by its `type`, derived from `AnyEvent` so the catalogue is written down once."""

__all__ = [
    "CLUSTER_POLICY_NODE",
    "EVENT_TYPES",
    "UNROUTED",
    "AgentHeartbeat",
    "AgentHeartbeatData",
    "AnyEvent",
    "ArtifactProduced",
    "ArtifactProducedData",
    "AttemptRequested",
    "AttemptRequestedData",
    "BlockingResource",
    "CancelRequested",
    "CheckpointRef",
    "CheckpointSaved",
    "CheckpointSavedData",
    "CheckpointStarted",
    "CheckpointStartedData",
    "ClusterPolicySet",
    "ClusterPolicySetData",
    "CommandData",
    "CommunicationEvidence",
    "CommunicatorReady",
    "CommunicatorReadyData",
    "ConsequenceGroup",
    "Culprit",
    "Data",
    "DrillInjected",
    "DrillInjectedData",
    "DrillKind",
    "Event",
    "EvidenceCategory",
    "EvidenceData",
    "Family",
    "FindingCause",
    "GpuDevice",
    "HeaderText",
    "Heartbeat",
    "HeartbeatData",
    "HoldRequested",
    "HoldRequestedData",
    "HostEvidence",
    "JobEvidence",
    "JobEvidenceData",
    "JobFinding",
    "JobFindingData",
    "JobPlaced",
    "JobPlacedData",
    "JobRejected",
    "JobRejectedData",
    "JobSlowdown",
    "JobSlowdownData",
    "JobStateChanged",
    "JobStateChangedData",
    "JobSubmitted",
    "JobSubmittedData",
    "JobWaiting",
    "JobWaitingData",
    "Lane",
    "LostWork",
    "ManualAction",
    "ManualActionData",
    "ManualActionRequested",
    "MissingEvidence",
    "NetworkEvidence",
    "NodeInventory",
    "NodeRegistered",
    "NodeRegisteredData",
    "NodeStateChanged",
    "NodeStateChangedData",
    "PlatformEvidence",
    "ProcessEvidence",
    "RankAssignment",
    "RankExited",
    "RankExitedData",
    "RankStarted",
    "RankStartedData",
    "RawEvidence",
    "RecoveryAction",
    "RecoveryDecided",
    "RecoveryDecidedData",
    "RecoveryEscalated",
    "RecoveryEscalatedData",
    "RecoverySuperseded",
    "RecoverySupersededData",
    "RefusedCheckpoint",
    "RendezvousDone",
    "RendezvousDoneData",
    "ReplicaListening",
    "ReplicaListeningData",
    "ReplicaState",
    "ReplicaStateChanged",
    "ReplicaStateChangedData",
    "RequestAttempt",
    "RequestServed",
    "RequestServedData",
    "ResourcesReleased",
    "ResourcesReleasedData",
    "ResumeRequested",
    "RetryData",
    "RetryRequested",
    "SettleWindowEnded",
    "SettleWindowEndedData",
    "StepTiming",
    "TransitionRejected",
    "TransitionRejectedData",
    "derive",
    "utc_now",
]
