"""The cluster model every service shares: nodes with their GPUs and topology, node states, pools, tenants.

Topology has four placement levels, tightest first: a node's NVLink/NVSwitch domain, its leaf switch, its
spine, and the whole cluster. A node that names no domain at some level is alone in it (it shares no
NVLink with anyone, and no leaf), so a constraint on that level can only be met inside the node itself.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field, model_validator

from lanes_contract.ids import validate_token

Name = Annotated[str, AfterValidator(validate_token)]
"""A subject-safe id (same rule as `lanes_contract.jobs.Token`, repeated here to avoid an import cycle)."""

OwnerLane = Literal["algorithm", "platform", "host", "network"]
"""The responsibility lane that owns a state or a wait (the values of `lanes_contract.events.Lane`)."""


class Level(StrEnum):
    """A topology level, from the tightest (one node) to the whole cluster."""

    NODE = "node"
    NVLINK = "nvlink"
    LEAF = "leaf"
    SPINE = "spine"
    CLUSTER = "cluster"

    @property
    def rank(self) -> int:
        """0 for the tightest level, 4 for the cluster."""
        return LEVELS.index(self)


LEVELS: tuple[Level, ...] = (Level.NODE, Level.NVLINK, Level.LEAF, Level.SPINE, Level.CLUSTER)
"""Levels tightest first."""

CLUSTER_DOMAIN = "cluster"


class NodeState(StrEnum):
    """Whether a node may take new work. Only `ready` nodes are ever placed on."""

    READY = "ready"
    CORDONED = "cordoned"
    DRAINING = "draining"
    UNHEALTHY = "unhealthy"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class NodeStatus(_Frozen):
    """A node's state, why it is in it, which lane put it there and since when."""

    state: NodeState = NodeState.READY
    reason: str = ""
    owner_lane: OwnerLane | None = None
    since: AwareDatetime | None = None


class Node(_Frozen):
    """One machine: its GPUs, where it sits in the network, its pool and labels, and its state."""

    node_id: Name
    gpu_model: str = Field(default="unknown", min_length=1)
    gpus: int = Field(default=0, ge=0, le=64)
    gpu_memory_gib: int = Field(default=0, ge=0)
    nvlink_domain: Name | None = None
    leaf: Name | None = None
    spine: Name | None = None
    rack: Name | None = None
    pool: Name = "default"
    labels: dict[str, str] = Field(default_factory=dict)
    status: NodeStatus = NodeStatus()

    def domain(self, level: Level) -> str:
        """The id of the domain this node belongs to at `level` (its own id where it names none)."""
        if level is Level.CLUSTER:
            return CLUSTER_DOMAIN
        value = {
            Level.NODE: self.node_id,
            Level.NVLINK: self.nvlink_domain,
            Level.LEAF: self.leaf,
            Level.SPINE: self.spine,
        }[level]
        return value or self.node_id


class Pool(_Frozen):
    """A resource pool (training, inference, evaluation, reserved ...); `reserved_for` limits who may use it."""

    name: Name
    reserved_for: tuple[Name, ...] = Field(
        default=(), description="Tenants allowed to use the pool; empty means every tenant."
    )

    def admits(self, tenant: str) -> bool:
        """Whether `tenant` may place work in this pool."""
        return not self.reserved_for or tenant in self.reserved_for


class Tenant(_Frozen):
    """A tenant and its GPU quota per pool (a pool without an entry is not limited)."""

    name: Name
    gpu_quota: dict[str, int] = Field(default_factory=dict)

    def quota(self, pool: str) -> int | None:
        """The tenant's GPU quota in `pool`, or None when unlimited."""
        return self.gpu_quota.get(pool)


class ClusterPolicy(_Frozen):
    """Pools and tenants: the admission policy that is not a property of any one node."""

    pools: tuple[Pool, ...] = ()
    tenants: tuple[Tenant, ...] = ()

    def pool(self, name: str) -> Pool:
        """The pool called `name` (an undeclared pool admits every tenant)."""
        return next((p for p in self.pools if p.name == name), Pool(name=name))

    def tenant(self, name: str) -> Tenant:
        """The tenant called `name` (an undeclared tenant has no quota)."""
        return next((t for t in self.tenants if t.name == name), Tenant(name=name))


class Cluster(_Frozen):
    """A whole inventory: nodes plus pools and tenants. The native import/export format (YAML or JSON)."""

    nodes: tuple[Node, ...] = ()
    policy: ClusterPolicy = ClusterPolicy()

    @model_validator(mode="after")
    def _unique_nodes(self) -> Cluster:
        seen: set[str] = set()
        for node in self.nodes:
            if node.node_id in seen:
                msg = f"node {node.node_id} appears twice"
                raise ValueError(msg)
            seen.add(node.node_id)
        return self

    def domains(self, level: Level) -> dict[str, tuple[str, ...]]:
        """Node ids per domain at `level`, domains and nodes in sorted order."""
        grouped: dict[str, list[str]] = {}
        for node in self.nodes:
            grouped.setdefault(node.domain(level), []).append(node.node_id)
        return {domain: tuple(sorted(ids)) for domain, ids in sorted(grouped.items())}


class TopologyConstraint(_Frozen):
    """Where a gang's workers must (or should) sit relative to each other.

    `required`: every worker in one domain of that level, or the gang waits. `preferred`: levels to try in
    order before falling back to anything `required` allows (the tightest level that fits is always tried
    first). `slice_workers` with `slice_level`: consecutive groups of that many workers each share one
    domain of `slice_level`, even when the gang as a whole spans more.
    """

    required: Level = Level.CLUSTER
    preferred: tuple[Level, ...] = ()
    slice_workers: int | None = Field(default=None, ge=1)
    slice_level: Level | None = None

    @model_validator(mode="after")
    def _consistent(self) -> TopologyConstraint:
        if (self.slice_workers is None) != (self.slice_level is None):
            msg = "slice_workers and slice_level go together"
            raise ValueError(msg)
        for level in self.preferred:
            if level.rank > self.required.rank:
                msg = f"preferred level {level} is broader than the required level {self.required}"
                raise ValueError(msg)
        if self.slice_level is not None and self.slice_level.rank > self.required.rank:
            msg = f"slice level {self.slice_level} is broader than the required level {self.required}"
            raise ValueError(msg)
        return self

    @property
    def preferred_level(self) -> Level:
        """The level the user would like: the first preferred one, else the required one."""
        return self.preferred[0] if self.preferred else self.required
