"""Gang admission and topology-aware placement: pure, deterministic, no I/O.

`CapacityView` holds what is free where (built from a snapshot; `hold` and `release` change it in memory).
`place_gang` finds the tightest topology domain that fits a whole gang (best fit over domains, not first
fit over nodes) or says it cannot; `explain` ranks why; `schedule` runs a queue in priority order with
backfill that never takes the nodes reserved for the highest-priority blocked gang.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from lanes_contract.events import BlockingResource, Lane, RankAssignment
from lanes_contract.topology import CLUSTER_DOMAIN, LEVELS, ClusterPolicy, Level, Node, NodeState, TopologyConstraint

ANY_TOPOLOGY = TopologyConstraint()
MAX_LISTED = 16
"""How many blocking resources or holders a reason names (the rest are counted in its figures)."""


class WaitReason(StrEnum):
    """Why a gang is not placed, most fundamental first."""

    SPEC_MISMATCH = "spec_mismatch"
    ISOLATED = "isolated"
    CAPACITY_SHORT = "capacity_short"
    TOPOLOGY_UNSATISFIABLE = "topology_unsatisfiable"


@dataclass(frozen=True)
class Gang:
    """One job attempt's request: N workers x G GPUs, placed together or not at all."""

    job_id: str
    attempt: int
    workers: int
    gpus_per_worker: int
    gpu_model: str | None = None
    gpu_memory_gib: int | None = None
    tenant: str = "default"
    pool: str = "default"
    priority: int = 0
    order: int = 0
    topology: TopologyConstraint = ANY_TOPOLOGY
    avoid_nodes: frozenset[str] = frozenset()
    """Nodes this attempt must never be placed on, whatever their state (e.g. the ones recovery cordoned)."""

    @property
    def key(self) -> str:
        """The holder id of this attempt's GPUs."""
        return f"{self.job_id}/{self.attempt}"

    @property
    def gpus(self) -> int:
        """GPUs the whole gang needs."""
        return self.workers * self.gpus_per_worker


@dataclass(frozen=True)
class Placed:
    """Where every rank goes, and the domain that holds the whole gang."""

    gang: Gang
    assignments: tuple[RankAssignment, ...]
    level: Level
    domain: str

    @property
    def in_preferred_level(self) -> bool:
        """Whether the gang landed inside the level the user preferred (or required)."""
        return self.level.rank <= self.gang.topology.preferred_level.rank


@dataclass(frozen=True)
class Waiting:
    """Why a gang waits: the ranked reason, the sentence, who can unblock it and what blocks it."""

    gang: Gang
    reason: WaitReason
    detail: str
    owner_lane: Lane
    blocking: tuple[BlockingResource, ...] = ()
    figures: Mapping[str, int] = field(default_factory=dict)
    queue_position: int = 1


@dataclass(frozen=True)
class Rejected:
    """A gang no cluster can ever place: its request contradicts itself (not: this inventory lacks the nodes)."""

    gang: Gang
    reason: WaitReason
    detail: str
    owner_lane: Lane
    figures: Mapping[str, int] = field(default_factory=dict)


Decision = Placed | Waiting | Rejected


@dataclass(frozen=True)
class Holding:
    """GPUs held by one job attempt on one node."""

    holder: str
    tenant: str
    pool: str
    node: str
    gpus: tuple[int, ...]


def _avoided(view: CapacityView, gang: Gang) -> frozenset[str]:
    """The nodes of the view the gang must avoid (a node not in the inventory cannot be placed on anyway)."""
    return frozenset(n for n in gang.avoid_nodes if n in view.nodes)


def _fits_spec(node: Node, gang: Gang) -> bool:
    return _fits(node, gang.gpu_model, gang.gpu_memory_gib) and node.gpus >= gang.gpus_per_worker


def _fits(node: Node, model: str | None, memory: float | None) -> bool:
    return (model is None or node.gpu_model == model) and (memory is None or node.gpu_memory_gib >= memory)


class CapacityView:
    """Free GPUs per node and per topology domain, with who holds the rest. Mutated only by hold/release."""

    def __init__(self, nodes: Iterable[Node], policy: ClusterPolicy, holdings: Iterable[Holding] = ()) -> None:
        self.policy = policy
        self.nodes: dict[str, Node] = {n.node_id: n for n in sorted(nodes, key=lambda n: n.node_id)}
        self.free: dict[str, list[int]] = {n.node_id: list(range(n.gpus)) for n in self.nodes.values()}
        self.holders: dict[str, dict[str, int]] = {n: {} for n in self.nodes}
        self.usage: dict[tuple[str, str], int] = {}
        self._held: dict[str, list[Holding]] = {}
        # Domains are indexed per pool (a gang only ever uses its own pool) and level.
        self._members: dict[tuple[str, Level], dict[str, list[str]]] = {}
        self._domain_free: dict[tuple[str, Level], dict[str, int]] = {}
        # Domains by free GPUs (best fit without sorting), and the largest domain each level can ever offer.
        self._buckets: dict[tuple[str, Level], dict[int, set[str]]] = {}
        self._largest_domain: dict[tuple[str, Level], int] = {}
        self.not_ready: dict[str, int] = {}
        self.node_kinds: dict[str, set[tuple[str, int, int]]] = {}
        self._capacity_cache: dict[tuple[object, ...], tuple[str, int]] = {}
        # Worker slots per domain for a given GPUs-per-worker, built on first use and kept up to date.
        self._slot_tables: dict[tuple[str, Level, int, str | None, float | None], dict[str, int]] = {}
        self._holders_in: dict[str, tuple[str, ...]] = {}
        """Each pool's holders, sorted: made again only when a job starts or stops holding there."""
        for node in self.nodes.values():
            self.node_kinds.setdefault(node.pool, set()).add((node.gpu_model, node.gpu_memory_gib, node.gpus))
            if node.status.state is not NodeState.READY:
                self.not_ready[node.pool] = self.not_ready.get(node.pool, 0) + 1
            for level in LEVELS:
                key = (node.pool, level)
                domain = node.domain(level)
                self._members.setdefault(key, {}).setdefault(domain, []).append(node.node_id)
                frees = self._domain_free.setdefault(key, {})
                frees[domain] = frees.get(domain, 0) + (node.gpus if node.status.state is NodeState.READY else 0)
        for key, frees in self._domain_free.items():
            buckets = self._buckets.setdefault(key, {})
            for domain, free in frees.items():
                buckets.setdefault(free, set()).add(domain)
            self._largest_domain[key] = max(frees.values(), default=0)
        for holding in holdings:
            self._take(holding)

    # --- changes ---------------------------------------------------------------------------------

    def _take(self, holding: Holding) -> None:
        node = self.nodes.get(holding.node)
        if node is None:
            return  # a holding on a node that left the inventory frees nothing and blocks nothing
        taken = set(holding.gpus)
        overlap = taken - set(self.free[holding.node])
        if overlap:
            msg = f"GPUs {sorted(overlap)} of {holding.node} are already held; {holding.holder} cannot take them"
            raise ValueError(msg)
        self.free[holding.node] = [g for g in self.free[holding.node] if g not in taken]
        holders = self.holders[holding.node]
        holders[holding.holder] = holders.get(holding.holder, 0) + len(taken)
        key = (holding.tenant, holding.pool)
        self.usage[key] = self.usage.get(key, 0) + len(taken)
        if holding.holder not in self._held:
            self._holders_in.pop(holding.pool, None)
        self._held.setdefault(holding.holder, []).append(holding)
        self._adjust(node, -len(taken))

    def _adjust(self, node: Node, delta: int) -> None:
        if node.status.state is not NodeState.READY:
            return
        after = len(self.free[node.node_id])
        for level in LEVELS:
            key = (node.pool, level)
            frees = self._domain_free[key]
            domain = node.domain(level)
            before = frees[domain]
            frees[domain] = before + delta
            buckets = self._buckets[key]
            left = buckets[before]
            left.discard(domain)
            if not left:
                del buckets[before]  # keep only values that some domain has, so lookups stay short
            buckets.setdefault(before + delta, set()).add(domain)
        for (pool, level, g, model, memory), table in self._slot_tables.items():
            if pool == node.pool and _fits(node, model, memory):
                table[node.domain(level)] += after // g - (after - delta) // g

    def slot_table(self, gang: Gang, level: Level) -> dict[str, int]:
        """The gang's worker slots per domain of `level` on ready nodes that fit its GPU spec, kept up to date.

        One table per spec (GPUs per worker, model, memory) and level, built on first use: with several GPU
        models in a pool, each spec counts only its own nodes, so no decision scans the nodes one by one.
        """
        g, model, memory = gang.gpus_per_worker, gang.gpu_model, gang.gpu_memory_gib
        key = (gang.pool, level, g, model, memory)
        table = self._slot_tables.get(key)
        if table is None:
            table = {}
            for domain, members in self._members.get((gang.pool, level), {}).items():
                table[domain] = sum(
                    len(self.free[n]) // g
                    for n in members
                    if self.nodes[n].status.state is NodeState.READY and _fits(self.nodes[n], model, memory)
                )
            self._slot_tables[key] = table
        return table

    def uniform(self, gang: Gang) -> bool:
        """Whether every node of the gang's pool fits its GPU spec."""
        kinds = self.node_kinds.get(gang.pool, set())
        return all(
            (gang.gpu_model is None or m == gang.gpu_model)
            and (gang.gpu_memory_gib is None or mem >= gang.gpu_memory_gib)
            and gpus >= gang.gpus_per_worker
            for m, mem, gpus in kinds
        )

    def best_fit_domains(self, pool: str, level: Level, need: int) -> Iterator[str]:
        """Domains of `level` with at least `need` free GPUs, fewest free first (then by id)."""
        buckets = self._buckets.get((pool, level), {})
        for free in sorted(f for f in buckets if f >= need):
            ids = buckets[free]
            if not ids:
                continue
            first = min(ids)  # usually the only one tried: sort the rest only when it does not fit
            yield first
            yield from sorted(ids - {first})

    def most_free_domains(self, pool: str, level: Level) -> Iterator[tuple[int, str]]:
        """(free GPUs, domain) of `level`, most free first (then by id): an upper bound on what each offers."""
        buckets = self._buckets.get((pool, level), {})
        for free in sorted((f for f in buckets if buckets[f]), reverse=True):
            for domain in sorted(buckets[free]):
                yield free, domain

    def node_buckets(self, pool: str) -> dict[int, set[str]]:
        """Ready nodes of `pool` by free GPUs (non-ready nodes count as 0 free)."""
        return self._buckets.get((pool, Level.NODE), {})

    def holders_in(self, pool: str) -> tuple[str, ...]:
        """Jobs holding GPUs in `pool`, sorted."""
        cached = self._holders_in.get(pool)
        if cached is None:
            cached = tuple(sorted(h for h, held in self._held.items() if held and held[0].pool == pool))
            self._holders_in[pool] = cached
        return cached

    def largest_domain(self, pool: str, level: Level) -> int:
        """GPUs on ready nodes of the largest domain of `level` when all is free."""
        return self._largest_domain.get((pool, level), 0)

    def hold(self, gang: Gang, assignments: Sequence[RankAssignment]) -> None:
        """Give the GPUs of a placement to the gang (raises ValueError if any is already held)."""
        per_node: dict[str, list[int]] = {}
        for assignment in assignments:
            per_node.setdefault(assignment.node, []).extend(assignment.gpus)
        for node, gpus in per_node.items():
            self._take(Holding(gang.key, gang.tenant, gang.pool, node, tuple(gpus)))

    def release(self, holder: str) -> int:
        """Free everything `holder` holds; return how many GPUs that was (0 if it held nothing)."""
        freed = 0
        held = self._held.pop(holder, [])
        if held:
            self._holders_in.pop(held[0].pool, None)
        for holding in held:
            node = self.nodes[holding.node]
            self.free[holding.node] = sorted([*self.free[holding.node], *holding.gpus])
            self.holders[holding.node].pop(holding.holder, None)
            key = (holding.tenant, holding.pool)
            self.usage[key] -= len(holding.gpus)
            self._adjust(node, len(holding.gpus))
            freed += len(holding.gpus)
        return freed

    # --- queries ---------------------------------------------------------------------------------

    def holders_of(self, node_ids: Iterable[str]) -> tuple[str, ...]:
        """Jobs holding GPUs on any of these nodes, sorted."""
        return tuple(sorted({h for n in node_ids for h in self.holders.get(n, {})}))

    def holders_for(self, tenant: str, pool: str) -> tuple[str, ...]:
        """Jobs of `tenant` holding GPUs in `pool`, sorted."""
        return tuple(sorted(h for h, held in self._held.items() if (held[0].tenant, held[0].pool) == (tenant, pool)))

    def domain_frees(self, pool: str, level: Level) -> dict[str, int]:
        """Free GPUs on ready nodes per domain of `level` in `pool` (an upper bound on what a gang can use)."""
        return self._domain_free.get((pool, level), {})

    def members(self, pool: str, level: Level) -> dict[str, list[str]]:
        """Node ids per domain of `level` in `pool`."""
        return self._members.get((pool, level), {})

    def domain_free(self, pool: str, level: Level, domain: str) -> int:
        """Free GPUs on ready nodes of one domain (all models)."""
        return self._domain_free.get((pool, level), {}).get(domain, 0)

    def slots(self, node_id: str, gang: Gang, excluded: frozenset[str], *, any_state: bool = False) -> int:
        """How many of the gang's workers fit on a node now."""
        node = self.nodes[node_id]
        if node_id in excluded or not _fits_spec(node, gang):
            return 0
        if not any_state and node.status.state is not NodeState.READY:
            return 0
        return len(self.free[node_id]) // gang.gpus_per_worker


def _levels_for(gang: Gang) -> tuple[Level, ...]:
    return tuple(level for level in LEVELS if level.rank <= gang.topology.required.rank)


def _slice_fit(
    view: CapacityView, gang: Gang, node_slots: Mapping[str, int]
) -> tuple[list[tuple[str, int]], int] | None:
    """Nodes ordered for taking, and how many workers they give; None when the slices cannot be formed."""
    constraint = gang.topology
    if constraint.slice_workers is None or constraint.slice_level is None:
        return None
    k = constraint.slice_workers
    groups: dict[str, list[str]] = {}
    for node_id in node_slots:
        groups.setdefault(view.nodes[node_id].domain(constraint.slice_level), []).append(node_id)
    order: list[tuple[str, int]] = []
    slices = 0
    for _, members in sorted(groups.items(), key=lambda kv: (-sum(node_slots[n] for n in kv[1]), kv[0])):
        usable = sum(node_slots[n] for n in members) // k * k
        if usable == 0:
            continue
        slices += usable // k
        for node_id in sorted(members, key=lambda n: (-node_slots[n], n)):
            take = min(node_slots[node_id], usable)
            if take:
                order.append((node_id, take))
                usable -= take
    return order, slices * k


def _assign(view: CapacityView, gang: Gang, order: Sequence[tuple[str, int]]) -> tuple[RankAssignment, ...]:
    assignments: list[RankAssignment] = []
    g = gang.gpus_per_worker
    for node_id, workers in order:
        free = view.free[node_id]
        for i in range(workers):
            if len(assignments) == gang.workers:
                return tuple(assignments)
            assignments.append(
                RankAssignment(rank=len(assignments), node=node_id, gpus=tuple(free[i * g : (i + 1) * g]))
            )
    return tuple(assignments)


def _try_domain(
    view: CapacityView, gang: Gang, level: Level, members: Sequence[str], excluded: frozenset[str]
) -> list[tuple[str, int]] | None:
    """The nodes of one domain to take, in order, with workers per node; None if the gang does not fit."""
    node_slots = {n: s for n in members if (s := view.slots(n, gang, excluded)) > 0}
    if sum(node_slots.values()) < gang.workers:
        return None
    sliced = _slice_fit(view, gang, node_slots)
    if sliced is not None:
        order, workers = sliced
        return order if workers >= gang.workers else None
    if level is Level.NODE:
        return list(node_slots.items())
    # Span as few child domains as possible: children with most room first, then fullest-free nodes,
    # which leaves partly used nodes to small gangs.
    child = LEVELS[level.rank - 1]
    child_slots: dict[str, int] = {}
    for node_id, s in node_slots.items():
        d = view.nodes[node_id].domain(child)
        child_slots[d] = child_slots.get(d, 0) + s
    ordered = sorted(
        node_slots,
        key=lambda n: (-child_slots[view.nodes[n].domain(child)], view.nodes[n].domain(child), -node_slots[n], n),
    )
    return [(n, node_slots[n]) for n in ordered]


def place_gang(view: CapacityView, gang: Gang, excluded: frozenset[str] = frozenset()) -> Placed | None:
    """The tightest domain that holds the whole gang (fewest free GPUs among those that fit), or None.

    Neither the `excluded` nodes (a reservation) nor the ones the gang must avoid are used.
    """
    if not view.policy.pool(gang.pool).admits(gang.tenant):
        return None
    excluded |= _avoided(view, gang)
    quota = view.policy.tenant(gang.tenant).quota(gang.pool)
    if quota is not None and view.usage.get((gang.tenant, gang.pool), 0) + gang.gpus > quota:
        return None
    need = gang.gpus
    for level in _levels_for(gang):
        if view.largest_domain(gang.pool, level) < need:
            continue  # no domain of this level could hold the gang even when idle
        members = view.members(gang.pool, level)
        slots = view.slot_table(gang, level)
        kept_back: dict[str, int] = {}
        for n in excluded:
            if view.nodes[n].pool == gang.pool:
                d = view.nodes[n].domain(level)
                kept_back[d] = kept_back.get(d, 0) + view.slots(n, gang, frozenset())
        for domain in view.best_fit_domains(gang.pool, level, need):
            if slots[domain] - kept_back.get(domain, 0) < gang.workers:
                continue
            order = _try_domain(view, gang, level, members[domain], excluded)
            if order is not None:
                return Placed(gang, _assign(view, gang, order), level, domain)
    return None


# --- why not ---------------------------------------------------------------------------------------


def _largest(
    view: CapacityView, gang: Gang, level: Level, excluded: frozenset[str], *, any_state: bool, empty: bool
) -> tuple[str, int]:
    """The domain of `level` with the most worker slots, and that many slots (capacity if `empty`)."""
    if empty:
        key = (gang.pool, level, gang.gpus_per_worker, gang.gpu_model, gang.gpu_memory_gib, any_state)
        cached = view._capacity_cache.get(key)  # noqa: SLF001 - the view's own memo of static facts
        if cached is None:
            cached = _largest_scan(view, gang, level, excluded, any_state=any_state, empty=True)
            view._capacity_cache[key] = cached  # noqa: SLF001
        return cached
    if any_state and view.not_ready.get(gang.pool, 0):
        return _largest_scan(view, gang, level, excluded, any_state=True, empty=False)
    table = view.slot_table(gang, level)
    if excluded:
        table = dict(table)
        for n in excluded:
            if view.nodes[n].pool == gang.pool:
                table[view.nodes[n].domain(level)] -= view.slots(n, gang, frozenset())
    if not table:
        return ("", 0)
    if view.uniform(gang):
        domain = min(table, key=lambda d: (-table[d], d))
    else:
        # Among domains with as many slots, the one with the most free GPUs of any model, then by id.
        frees = view.domain_frees(gang.pool, level)
        domain = min(table, key=lambda d: (-table[d], -frees.get(d, 0), d))
    return (domain, table[domain]) if table[domain] > 0 else ("", 0)


def _largest_scan(
    view: CapacityView, gang: Gang, level: Level, excluded: frozenset[str], *, any_state: bool, empty: bool
) -> tuple[str, int]:
    best = ("", 0)
    for domain, members in sorted(view.members(gang.pool, level).items()):
        total = 0
        for n in members:
            node = view.nodes[n]
            if not _fits_spec(node, gang) or (not any_state and node.status.state is not NodeState.READY):
                continue
            if n in excluded:
                continue
            total += (node.gpus if empty else len(view.free[n])) // gang.gpus_per_worker
        if total > best[1]:
            best = (domain, total)
    return best


def _free_slots(view: CapacityView, gang: Gang, excluded: frozenset[str]) -> int:
    """Workers of the gang that fit on ready, non-excluded nodes of its pool right now."""
    total = view.slot_table(gang, Level.CLUSTER).get(CLUSTER_DOMAIN, 0)
    return total - sum(view.slots(n, gang, frozenset()) for n in excluded if view.nodes[n].pool == gang.pool)


def explain(
    view: CapacityView, gang: Gang, excluded: frozenset[str] = frozenset(), reserved_for: str = ""
) -> Waiting | Rejected:
    """The most fundamental reason the gang is not placed now (call it after `place_gang` said None)."""
    g = gang.gpus_per_worker
    avoided = _avoided(view, gang)
    required = gang.topology.required
    spec = f"{g} GPUs of {gang.gpu_model or 'any model'}" + (
        f" with >= {gang.gpu_memory_gib} GiB" if gang.gpu_memory_gib else ""
    )
    k = gang.topology.slice_workers
    if k is not None and gang.workers % k:
        # The request contradicts itself: no inventory can ever place it.
        return Rejected(
            gang, WaitReason.SPEC_MISMATCH, f"{gang.workers} workers cannot be cut into slices of {k}", Lane.ALGORITHM
        )
    # No node of the inventory fits the spec: the job waits (rather than being rejected), because the
    # inventory is what the scheduler has read so far, not what the cluster is. Nodes register while jobs are
    # submitted (a cold start, a pool being built) and the two arrive on different streams, so a rejection
    # here would turn the order of two reads into a job's fate. Every inventory change decides it again.
    kinds = view.node_kinds.get(gang.pool, set())
    fitting_kinds = {
        k for k in kinds if _fits_spec(Node(node_id="kind", gpu_model=k[0], gpu_memory_gib=k[1], gpus=k[2]), gang)
    }
    if not fitting_kinds:
        return Waiting(
            gang,
            WaitReason.SPEC_MISMATCH,
            f"no node in pool {gang.pool} has {spec} for one worker (it waits for one to register)",
            Lane.ALGORITHM,
            figures={"needed_gpus": gang.gpus, "matching_nodes": 0},
        )
    domain, capacity = _largest(view, gang, required, frozenset(), any_state=True, empty=True)
    if capacity < gang.workers:
        where = "in the cluster" if required is Level.CLUSTER else f"under one {required}"
        why = (
            f"needs {gang.gpus} GPUs ({gang.workers}x{spec}) {where}; the largest has room for "
            f"{capacity * g} ({domain}) (it waits for more nodes to register)"
        )
        return Waiting(
            gang,
            WaitReason.SPEC_MISMATCH,
            why,
            Lane.ALGORITHM,
            figures={"needed_gpus": gang.gpus, "largest_domain_capacity_gpus": capacity * g},
        )
    pool = view.policy.pool(gang.pool)
    if not pool.admits(gang.tenant):
        pool_block = BlockingResource(
            kind="pool",
            id=gang.pool,
            reason=f"reserved for {', '.join(pool.reserved_for)}",
            owner_lane=Lane.PLATFORM,
        )
        return Waiting(
            gang,
            WaitReason.ISOLATED,
            f"pool {gang.pool} is reserved for {', '.join(pool.reserved_for)}; tenant {gang.tenant} may not use it",
            Lane.PLATFORM,
            (pool_block,),
        )
    quota = view.policy.tenant(gang.tenant).quota(gang.pool)
    used = view.usage.get((gang.tenant, gang.pool), 0)
    if quota is not None and used + gang.gpus > quota:
        own = view.holders_for(gang.tenant, gang.pool)
        quota_block = BlockingResource(
            kind="quota",
            id=f"{gang.tenant}/{gang.pool}",
            holders=own[:MAX_LISTED],
            free_gpus=max(quota - used, 0),
            reason=f"quota {quota} GPUs, {used} in use",
            owner_lane=Lane.PLATFORM,
        )
        return Waiting(
            gang,
            WaitReason.ISOLATED,
            f"tenant {gang.tenant} uses {used} of its {quota} GPU quota in pool {gang.pool}; needs {gang.gpus} more",
            Lane.PLATFORM,
            (quota_block,),
            {"needed_gpus": gang.gpus, "quota_gpus": quota, "used_gpus": used},
        )
    if avoided:
        isolated = _isolated_by_avoided_nodes(view, gang, excluded, avoided)
        if isolated is not None:
            return isolated
    kept_out = excluded | avoided
    free_slots = _free_slots(view, gang, kept_out)
    figures = {"needed_gpus": gang.gpus, "free_gpus": free_slots * g}
    ready_domain, ready_largest = _largest(view, gang, required, kept_out, any_state=False, empty=False)
    if ready_largest < gang.workers:
        _, with_down = _largest(view, gang, required, kept_out, any_state=True, empty=False)
        if with_down >= gang.workers:
            down = [
                n
                for n in view.nodes.values()
                if n.pool == gang.pool
                and n.node_id not in avoided
                and _fits_spec(n, gang)
                and n.status.state is not NodeState.READY
                and view.free[n.node_id]
            ]
            blocking = tuple(
                BlockingResource(
                    kind="node",
                    id=n.node_id,
                    holders=view.holders_of([n.node_id]),
                    free_gpus=len(view.free[n.node_id]),
                    state=n.status.state.value,
                    reason=n.status.reason,
                    owner_lane=Lane(n.status.owner_lane) if n.status.owner_lane else Lane.PLATFORM,
                )
                for n in down[:MAX_LISTED]
            )
            names = ", ".join(f"{b.id} ({b.state}: {b.reason or 'no reason given'})" for b in blocking[:4])
            return Waiting(
                gang,
                WaitReason.ISOLATED,
                f"would fit but needs nodes that are not ready: {names}",
                blocking[0].owner_lane or Lane.PLATFORM,
                blocking,
                figures | {"not_ready_nodes": len(down)},
            )
    if excluded:
        _, unreserved = _largest(view, gang, required, avoided, any_state=False, empty=False)
        if unreserved >= gang.workers:
            blocking = (
                BlockingResource(
                    kind="reservation",
                    id=reserved_for or "head-of-line",
                    holders=(reserved_for,) if reserved_for else (),
                    reason="free GPUs are kept for the first gang in line so backfill never delays it",
                    owner_lane=Lane.PLATFORM,
                ),
            )
            return Waiting(
                gang,
                WaitReason.ISOLATED,
                f"the GPUs that would fit are reserved for {reserved_for or 'the head-of-line gang'}",
                Lane.PLATFORM,
                blocking,
                figures | {"reserved_nodes": len(excluded)},
            )
    if free_slots < gang.workers:
        holders = view.holders_in(gang.pool)
        blocking = (
            BlockingResource(
                kind="capacity",
                id=gang.pool,
                holders=holders[:MAX_LISTED],
                free_gpus=free_slots * g,
                reason=f"{len(holders)} jobs hold the matching GPUs",
                owner_lane=Lane.PLATFORM,
            ),
        )
        return Waiting(
            gang,
            WaitReason.CAPACITY_SHORT,
            f"needs {gang.gpus} GPUs ({gang.workers}x{spec}); {free_slots * g} matching GPUs are free",
            Lane.PLATFORM,
            blocking,
            figures,
        )
    level_name = "one node" if required is Level.NODE else f"one {required}"
    detail = (
        f"needs {gang.gpus} GPUs under {level_name}; the largest free {required} has {ready_largest * g} "
        f"({ready_domain}); {free_slots * g} free in total"
    )
    members = view.members(gang.pool, required).get(ready_domain, [])
    blocking = (
        BlockingResource(
            kind="domain",
            id=ready_domain or "none",
            holders=view.holders_of(members)[:MAX_LISTED],
            free_gpus=ready_largest * g,
            reason=f"largest free {required}",
            owner_lane=Lane.PLATFORM,
        ),
    )
    return Waiting(
        gang,
        WaitReason.TOPOLOGY_UNSATISFIABLE,
        detail,
        Lane.PLATFORM,
        blocking,
        figures | {"largest_free_domain_gpus": ready_largest * g},
    )


def _isolated_by_avoided_nodes(
    view: CapacityView, gang: Gang, excluded: frozenset[str], avoided: frozenset[str]
) -> Waiting | None:
    """Isolated when the gang would fit (once every node is ready) only by using nodes it must avoid."""
    required = gang.topology.required
    _, with_avoided = _largest(view, gang, required, excluded, any_state=True, empty=False)
    _, without_avoided = _largest(view, gang, required, excluded | avoided, any_state=True, empty=False)
    if not without_avoided < gang.workers <= with_avoided:
        return None
    blocking = tuple(
        BlockingResource(
            kind="node",
            id=n,
            holders=view.holders_of([n]),
            free_gpus=len(view.free[n]),
            state=view.nodes[n].status.state.value,
            reason="this attempt must avoid it",
            owner_lane=Lane.PLATFORM,
        )
        for n in sorted(avoided)[:MAX_LISTED]
    )
    names = ", ".join(b.id for b in blocking[:4])
    return Waiting(
        gang,
        WaitReason.ISOLATED,
        f"would fit only by using nodes this attempt must avoid: {names}",
        Lane.PLATFORM,
        blocking,
        {"needed_gpus": gang.gpus, "avoided_nodes": len(avoided)},
    )


# --- the queue -------------------------------------------------------------------------------------


def reservation(view: CapacityView, gang: Gang) -> frozenset[str]:
    """Nodes kept for a blocked head-of-line gang: the domain closest to fitting it, just enough of it.

    The domain is the tightest level's one that could hold the gang when idle and has the most free GPUs.
    """
    avoided = _avoided(view, gang)
    chosen: tuple[str, Level] | None = None
    for level in _levels_for(gang):
        if view.largest_domain(gang.pool, level) < gang.gpus:
            continue
        members = view.members(gang.pool, level)
        for _, domain in view.most_free_domains(gang.pool, level):
            capacity = sum(
                view.nodes[n].gpus // gang.gpus_per_worker
                for n in members[domain]
                if n not in avoided
                and view.nodes[n].status.state is NodeState.READY
                and _fits_spec(view.nodes[n], gang)
            )
            if capacity >= gang.workers:
                chosen = (domain, level)
                break
        if chosen is not None:
            break
    if chosen is None:
        return frozenset()
    domain, level = chosen
    kept_domain = view.members(gang.pool, level)[domain]
    if gang.topology.slice_workers is not None:
        return frozenset(kept_domain)
    ready = [
        n
        for n in kept_domain
        if n not in avoided and view.nodes[n].status.state is NodeState.READY and _fits_spec(view.nodes[n], gang)
    ]
    kept: list[str] = []
    covered = 0
    for n in sorted(ready, key=lambda n: (-view.slots(n, gang, frozenset()), n)):
        kept.append(n)
        covered += view.nodes[n].gpus // gang.gpus_per_worker
        if covered >= gang.workers:
            break
    return frozenset(kept)


def queue_order(gangs: Iterable[Gang]) -> list[Gang]:
    """Highest priority first, then first come first served."""
    return sorted(gangs, key=lambda g: (-g.priority, g.order, g.job_id, g.attempt))


def schedule(view: CapacityView, gangs: Iterable[Gang]) -> list[Decision]:
    """Decide every queued gang, in queue order; placements are applied to `view` as they are made.

    The first gang that waits for capacity or topology reserves the nodes closest to fitting it; later
    gangs may backfill anything else but never those nodes, so backfill cannot delay it.
    """
    decisions: list[Decision] = []
    excluded: frozenset[str] = frozenset()
    reserved_for = ""
    position = 0
    # While nothing is placed and the reservation stands, a gang shaped like one that just failed fails
    # the same way for the same reason: decide it once (a long queue of alike jobs costs one decision).
    failed: dict[tuple[object, ...], Waiting | Rejected] = {}
    for gang in queue_order(gangs):
        shape = (
            gang.workers,
            gang.gpus_per_worker,
            gang.gpu_model,
            gang.gpu_memory_gib,
            gang.tenant,
            gang.pool,
            gang.topology,
            gang.avoid_nodes,
        )
        why: Waiting | Rejected | None = failed.get(shape)
        if why is None:
            placed = place_gang(view, gang, excluded)
            if placed is not None:
                view.hold(gang, placed.assignments)
                decisions.append(placed)
                failed.clear()
                continue
            why = explain(view, gang, excluded, reserved_for)
            failed[shape] = why
        if isinstance(why, Waiting):
            position += 1
            # Built once, for this gang at its place in the queue (a known shape's reason is reused as it is).
            why = Waiting(
                gang, why.reason, why.detail, why.owner_lane, why.blocking, why.figures, queue_position=position
            )
            if not reserved_for and why.reason in {WaitReason.CAPACITY_SHORT, WaitReason.TOPOLOGY_UNSATISFIABLE}:
                excluded = reservation(view, gang)
                reserved_for = gang.job_id
                failed.clear()
        elif why.gang is not gang:
            why = replace(why, gang=gang)
        decisions.append(why)
    return decisions
