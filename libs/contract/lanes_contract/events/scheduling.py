"""Nodes and scheduling decisions: registration, node state, cluster policy, rejection."""

from __future__ import annotations

from pydantic import Field

from lanes_contract.events.base import Data, Event, Family, Lane
from lanes_contract.jobs import Token
from lanes_contract.topology import ClusterPolicy, NodeState


class NodeRegisteredData(Data):
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
    lane: Lane = Lane.HOST
    data: NodeRegisteredData


class JobRejectedData(Data):
    """Why the job can never be placed."""

    reason: str = Field(min_length=1)
    detail: str = ""
    owner_lane: Lane | None = None
    figures: dict[str, int] = Field(default_factory=dict)


class JobRejected(Event):
    """The scheduler will never place this job: its request contradicts itself (a missing node only makes it wait)."""

    family = Family.JOB
    name = "rejected"
    lane: Lane = Lane.PLATFORM
    data: JobRejectedData


class NodeStateChangedData(Data):
    """A node's new state; the event's `lane` is the lane that owns the change (who to ask)."""

    state: NodeState
    reason: str = ""


class NodeStateChanged(Event):
    """A node was cordoned, drained, marked unhealthy, or made ready again."""

    family = Family.NODE
    name = "state_changed"
    lane: Lane = Lane.PLATFORM
    data: NodeStateChangedData


CLUSTER_POLICY_NODE = "cluster-policy"
"""The node token under which cluster-wide policy travels: `lanes.node.cluster-policy.policy_set`."""


class ClusterPolicySetData(Data):
    """The pools and tenant quotas that now apply (replaces the previous policy)."""

    policy: ClusterPolicy


class ClusterPolicySet(Event):
    """Pools and tenant GPU quotas were set."""

    family = Family.NODE
    name = "policy_set"
    lane: Lane = Lane.PLATFORM
    node: Token | None = CLUSTER_POLICY_NODE
    data: ClusterPolicySetData
