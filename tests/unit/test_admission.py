"""The pure admission core: topology-aware best fit, ranked wait reasons, quotas, priority with backfill."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lanes_contract.events import Lane, RankAssignment
from lanes_contract.topology import ClusterPolicy, Level, Node, NodeState, NodeStatus, Pool, Tenant, TopologyConstraint
from lanes_scheduler.domain.admission import (
    CapacityView,
    Gang,
    Placed,
    Rejected,
    Waiting,
    WaitReason,
    explain,
    place_gang,
    reservation,
    schedule,
)


def _cluster(spines: int = 1, leaves: int = 2, domains: int = 2, nodes: int = 2, gpus: int = 8) -> list[Node]:
    """spines x leaves x nvlink domains x nodes, named s0-l1-d0-n1 style."""
    return [
        Node(
            node_id=f"s{s}-l{lf}-d{d}-n{n}",
            gpu_model="H100",
            gpus=gpus,
            gpu_memory_gib=80,
            nvlink_domain=f"nvl-s{s}-l{lf}-d{d}",
            leaf=f"leaf-s{s}-l{lf}",
            spine=f"spine-{s}",
        )
        for s in range(spines)
        for lf in range(leaves)
        for d in range(domains)
        for n in range(nodes)
    ]


def _gang(job: str, workers: int, gpus: int = 8, **kw: object) -> Gang:
    kw.setdefault("attempt", 1)
    return Gang(job_id=job, workers=workers, gpus_per_worker=gpus, **kw)  # type: ignore[arg-type]


def _view(nodes: list[Node], policy: ClusterPolicy | None = None) -> CapacityView:
    return CapacityView(nodes, policy or ClusterPolicy())


def test_a_gang_goes_to_the_tightest_domain_that_fits_and_best_fit_among_them():
    view = _view(_cluster())
    # Occupy one GPU-half of nvl-s0-l0-d0 so that domain is the tighter fit for a 4-GPU gang.
    first = place_gang(view, _gang("a", 1, 4))
    assert isinstance(first, Placed)
    assert first.level is Level.NODE
    view.hold(first.gang, first.assignments)
    second = place_gang(view, _gang("b", 1, 4))
    assert isinstance(second, Placed)
    assert second.assignments[0].node == first.assignments[0].node  # best fit: fill the used node first
    two_nodes = place_gang(view, _gang("c", 2, 8))
    assert isinstance(two_nodes, Placed)
    assert two_nodes.level is Level.NVLINK
    assert len({a.node for a in two_nodes.assignments}) == 2


def test_best_fit_packs_small_gangs_so_a_whole_leaf_stays_free():
    view = _view(_cluster(leaves=2, domains=2, nodes=2))  # 2 leaves x 32 GPUs
    for job in ("x", "y"):
        blocker = _gang(job, 1, 8)
        view.hold(blocker, place_gang(view, blocker).assignments)  # type: ignore[union-attr]
    assert view.holders_of(n for n in view.nodes if n.startswith("s0-l1")) == ()
    big = place_gang(view, _gang("big", 4, 8, topology=TopologyConstraint(required=Level.LEAF)))
    assert isinstance(big, Placed)
    assert (big.level, big.domain) == (Level.LEAF, "leaf-s0-l1")


def test_topology_unsatisfiable_names_the_largest_free_leaf_and_its_holders():
    nodes = _cluster(leaves=2, domains=2, nodes=2)
    view = _view(nodes)
    # One 8-GPU job on each leaf: 24 free per leaf, 48 in total; a 32-GPU gang needing one leaf waits.
    view.hold(_gang("x", 1), list(place_gang(view, _gang("x", 1)).assignments))  # type: ignore[union-attr]
    leaf1_node = next(n for n in nodes if n.leaf == "leaf-s0-l1")
    view.hold(_gang("y", 1), [RankAssignment(rank=0, node=leaf1_node.node_id, gpus=tuple(range(8)))])
    gang = _gang("big", 4, 8, topology=TopologyConstraint(required=Level.LEAF))
    assert place_gang(view, gang) is None
    why = explain(view, gang)
    assert isinstance(why, Waiting)
    assert why.reason is WaitReason.TOPOLOGY_UNSATISFIABLE
    assert "needs 32 GPUs under one leaf; the largest free leaf has 24" in why.detail
    assert "48 free in total" in why.detail
    (block,) = why.blocking
    assert block.kind == "domain"
    assert block.holders in (("x/1",), ("y/1",))
    assert why.figures["largest_free_domain_gpus"] == 24
    assert why.owner_lane is Lane.PLATFORM


def test_capacity_short_names_the_holders():
    view = _view(_cluster(leaves=1, domains=1, nodes=2))
    view.hold(_gang("x", 2), place_gang(view, _gang("x", 2)).assignments)  # type: ignore[union-attr]
    why = explain(view, _gang("w", 1))
    assert isinstance(why, Waiting)
    assert why.reason is WaitReason.CAPACITY_SHORT
    assert why.blocking[0].holders == ("x/1",)
    assert why.figures == {"needed_gpus": 8, "free_gpus": 0}


def test_a_spec_no_node_fits_waits_for_one_and_only_a_self_contradicting_spec_is_rejected():
    view = _view(_cluster())
    model = explain(view, _gang("m", 1, 8, gpu_model="B200"))
    assert isinstance(model, Waiting)  # a B200 node may register yet: the inventory is what was read so far
    assert (model.reason, model.owner_lane) == (WaitReason.SPEC_MISMATCH, Lane.ALGORITHM)
    assert "no node in pool default has 8 GPUs of B200" in model.detail
    memory = explain(view, _gang("m", 1, 8, gpu_memory_gib=141))
    assert isinstance(memory, Waiting)
    assert memory.reason is WaitReason.SPEC_MISMATCH
    too_big = explain(view, _gang("t", 5, 8, topology=TopologyConstraint(required=Level.NVLINK)))
    assert isinstance(too_big, Waiting)
    assert too_big.reason is WaitReason.SPEC_MISMATCH
    assert "largest has room for 16" in too_big.detail
    uneven = explain(view, _gang("u", 3, 8, topology=TopologyConstraint(slice_workers=2, slice_level=Level.NODE)))
    assert isinstance(uneven, Rejected)
    assert uneven.detail == "3 workers cannot be cut into slices of 2"


def test_a_waiting_spec_mismatch_is_placed_once_a_node_that_fits_registers_and_reserves_nothing():
    b200 = _gang("b", 1, 8, gpu_model="B200")
    small = _gang("s", 1, 8, order=1)
    waiting, placed = schedule(_view(_cluster()), [b200, small])
    assert isinstance(waiting, Waiting)
    assert waiting.reason is WaitReason.SPEC_MISMATCH
    assert isinstance(placed, Placed)  # the mismatch holds no reservation that would keep the next job out
    grown = [*_cluster(), Node(node_id="b200-n0", gpu_model="B200", gpus=8, gpu_memory_gib=192)]
    (first, _) = schedule(_view(grown), [b200, small])
    assert isinstance(first, Placed)
    assert {a.node for a in first.assignments} == {"b200-n0"}


def test_isolated_by_cordoned_nodes_names_them_with_owner_and_reason():
    nodes = [
        n.model_copy(
            update={
                "status": NodeStatus(state=NodeState.CORDONED, reason="fan failure", owner_lane="host"),
            }
        )
        if n.node_id.endswith("n1")
        else n
        for n in _cluster(leaves=1, domains=1, nodes=2)
    ]
    view = _view(nodes)
    gang = _gang("w", 2)
    assert place_gang(view, gang) is None
    why = explain(view, gang)
    assert isinstance(why, Waiting)
    assert why.reason is WaitReason.ISOLATED
    (block,) = why.blocking
    assert (block.id, block.state, block.reason, block.owner_lane) == (
        "s0-l0-d0-n1",
        "cordoned",
        "fan failure",
        Lane.HOST,
    )
    assert why.owner_lane is Lane.HOST


def test_a_gang_is_never_placed_on_the_nodes_it_must_avoid_even_when_they_fit_best():
    view = _view(_cluster(leaves=1, domains=1, nodes=2))
    half = place_gang(view, _gang("half", 1, 4))
    assert isinstance(half, Placed)
    view.hold(half.gang, half.assignments)
    used = half.assignments[0].node
    best_fit = place_gang(view, _gang("b", 1, 4))
    assert isinstance(best_fit, Placed)
    assert best_fit.assignments[0].node == used  # without avoiding, the half-used node is the tightest fit
    avoiding = place_gang(view, _gang("b", 1, 4, avoid_nodes=frozenset({used})))
    assert isinstance(avoiding, Placed)
    assert {a.node for a in avoiding.assignments} == {"s0-l0-d0-n0", "s0-l0-d0-n1"} - {used}


def test_a_gang_that_fits_only_on_nodes_it_must_avoid_waits_isolated_naming_them():
    nodes = [
        n.model_copy(update={"status": NodeStatus(state=NodeState.CORDONED, reason="xid 79", owner_lane="host")})
        if n.node_id.endswith("n1")
        else n
        for n in _cluster(leaves=1, domains=1, nodes=2)
    ]
    view = _view(nodes)
    gang = _gang("w", 2, attempt=2, avoid_nodes=frozenset({"s0-l0-d0-n1"}))
    (decision,) = schedule(view, [gang])
    assert isinstance(decision, Waiting)
    assert decision.reason is WaitReason.ISOLATED
    assert "must avoid: s0-l0-d0-n1" in decision.detail  # not "wait until it is ready": it is never to be used
    assert [(b.kind, b.id, b.state) for b in decision.blocking] == [("node", "s0-l0-d0-n1", "cordoned")]
    assert decision.figures["avoided_nodes"] == 1


def test_a_gang_that_is_short_of_capacity_anyway_is_not_blamed_on_the_nodes_it_avoids():
    view = _view(_cluster(leaves=1, domains=1, nodes=2))
    why = explain(view, _gang("w", 3, avoid_nodes=frozenset({"s0-l0-d0-n1"})))
    assert isinstance(why, Waiting)  # three workers never fit on two nodes, avoided or not
    assert why.reason is WaitReason.SPEC_MISMATCH
    view = _view(_cluster(leaves=1, domains=1, nodes=3))
    view.hold(_gang("x", 1), place_gang(view, _gang("x", 1)).assignments)  # type: ignore[union-attr]
    why = explain(view, _gang("w", 3, avoid_nodes=frozenset({"s0-l0-d0-n2"})))
    assert isinstance(why, Waiting)
    assert why.reason is WaitReason.CAPACITY_SHORT


def test_avoiding_a_node_that_is_not_in_the_inventory_changes_nothing():
    view = _view(_cluster(leaves=1, domains=1, nodes=2))
    placed = place_gang(view, _gang("w", 2, avoid_nodes=frozenset({"gone-node"})))
    assert isinstance(placed, Placed)


def test_isolated_by_quota_and_by_reserved_pool():
    policy = ClusterPolicy(
        pools=(Pool(name="default"), Pool(name="vip", reserved_for=("research",))),
        tenants=(Tenant(name="team-a", gpu_quota={"default": 8}),),
    )
    nodes = _cluster(leaves=1, domains=1, nodes=2)
    vip = [n.model_copy(update={"node_id": f"vip-{n.node_id}", "pool": "vip"}) for n in nodes]
    view = _view(nodes + vip, policy)
    ok = place_gang(view, _gang("a", 1, tenant="team-a"))
    assert isinstance(ok, Placed)
    view.hold(ok.gang, ok.assignments)
    over = _gang("b", 1, tenant="team-a")
    assert place_gang(view, over) is None
    why = explain(view, over)
    assert isinstance(why, Waiting)
    assert why.reason is WaitReason.ISOLATED
    assert why.blocking[0].kind == "quota"
    assert why.blocking[0].holders == ("a/1",)
    pool = explain(view, _gang("c", 1, tenant="team-a", pool="vip"))
    assert isinstance(pool, Waiting)
    assert pool.reason is WaitReason.ISOLATED
    assert pool.blocking[0].kind == "pool"


def test_backfill_never_takes_the_nodes_reserved_for_the_head_of_line_gang():
    view = _view(_cluster(leaves=1, domains=1, nodes=4))  # one nvlink domain of 4 nodes
    running = _gang("run", 2, order=0)
    view.hold(running, place_gang(view, running).assignments)  # type: ignore[union-attr]
    big = _gang("big", 4, priority=5, order=1)  # needs all four nodes: waits for `run`
    small = _gang("small", 1, order=2)  # would fit on a free node, but that node is reserved
    decisions = schedule(view, [small, big])
    by_job = {d.gang.job_id: d for d in decisions}
    assert isinstance(by_job["big"], Waiting)
    assert by_job["big"].reason is WaitReason.CAPACITY_SHORT
    assert by_job["big"].queue_position == 1
    assert isinstance(by_job["small"], Waiting)
    assert by_job["small"].reason is WaitReason.ISOLATED
    assert by_job["small"].blocking[0].kind == "reservation"
    assert by_job["small"].queue_position == 2


def test_backfill_uses_nodes_outside_the_reservation():
    view = _view(_cluster(leaves=2, domains=1, nodes=2))  # two leaves of 2 nodes
    running = _gang("run", 1)
    view.hold(running, place_gang(view, running).assignments)  # type: ignore[union-attr]
    big = _gang("big", 2, priority=5, topology=TopologyConstraint(required=Level.LEAF))
    # `big` fits on the whole free leaf right away; a second big one must wait and reserve.
    big2 = _gang("big2", 2, priority=5, order=1, topology=TopologyConstraint(required=Level.LEAF))
    small = _gang("small", 1, order=2)
    decisions = {d.gang.job_id: d for d in schedule(view, [big, big2, small])}
    assert isinstance(decisions["big"], Placed)
    assert isinstance(decisions["big2"], Waiting)
    # The only free node is on the leaf reserved for big2.
    assert isinstance(decisions["small"], Waiting)


def test_slices_keep_groups_of_workers_inside_one_domain():
    view = _view(_cluster(leaves=1, domains=2, nodes=2))  # 2 nvlink domains x 2 nodes
    # Leave 1 node free in domain 0 and 2 in domain 1, minus one GPU on one node of domain 1.
    gang = _gang("s", 4, 4, topology=TopologyConstraint(required=Level.LEAF, slice_workers=2, slice_level=Level.NODE))
    placed = place_gang(view, gang)
    assert isinstance(placed, Placed)
    per_node: dict[str, list[int]] = {}
    for a in placed.assignments:
        per_node.setdefault(a.node, []).append(a.rank)
    assert all(len(ranks) % 2 == 0 for ranks in per_node.values())


_ops = st.lists(
    st.tuples(
        st.sampled_from(["place", "release"]),
        st.integers(1, 6),
        st.sampled_from([1, 2, 4, 8]),
        st.sampled_from(list(Level)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(_ops)
def test_never_double_books_and_is_all_or_nothing(ops):
    view = _view(_cluster(spines=2, leaves=2, domains=1, nodes=2))
    live: list[Gang] = []
    for i, (op, workers, gpus, level) in enumerate(ops):
        if op == "release" and live:
            gone = live.pop(0)
            freed = view.release(gone.key)
            assert freed == gone.gpus
            assert view.release(gone.key) == 0  # a second release frees nothing
            continue
        gang = _gang(f"j{i}", workers, gpus, topology=TopologyConstraint(required=level))
        placed = place_gang(view, gang)
        if placed is None:
            continue
        assert len(placed.assignments) == workers
        assert all(len(a.gpus) == gpus for a in placed.assignments)
        domains = {view.nodes[a.node].domain(level) for a in placed.assignments}
        assert len(domains) == 1
        view.hold(gang, placed.assignments)  # raises if any GPU were already held
        live.append(gang)
    held = [(n, g) for holding in view._held.values() for h in holding for n, g in [(h.node, x) for x in h.gpus]]
    assert len(held) == len(set(held))
    for node_id, free in view.free.items():
        assert not {g for n, g in held if n == node_id} & set(free)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.sampled_from([1, 2, 4, 8]), st.integers(0, 3)), max_size=25))
def test_schedule_is_deterministic_and_independent_of_input_order(specs):
    gangs = [_gang(f"j{i}", w, g, priority=p, order=i) for i, (w, g, p) in enumerate(specs)]

    def run(order: list[Gang]) -> list[tuple[str, str]]:
        view = _view(_cluster(spines=1, leaves=2, domains=2, nodes=2))
        return sorted(
            (d.gang.job_id, repr(d.assignments) if isinstance(d, Placed) else f"{d.reason}:{d.detail}")
            for d in schedule(view, order)
        )

    assert run(gangs) == run(list(reversed(gangs)))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 4), st.sampled_from([2, 4, 8])), min_size=1, max_size=6),
    st.lists(
        st.tuples(st.integers(1, 6), st.sampled_from([1, 2, 4, 8]), st.integers(0, 2), st.sampled_from(list(Level))),
        min_size=1,
        max_size=12,
    ),
)
def test_backfill_never_touches_the_nodes_reserved_for_the_head_of_line_gang(running, queued):
    nodes = _cluster(spines=1, leaves=2, domains=2, nodes=2)

    def fresh() -> CapacityView:
        view = _view(nodes)
        for i, (workers, gpus) in enumerate(running):
            gang = _gang(f"r{i}", workers, gpus)
            placed = place_gang(view, gang)
            if placed is not None:
                view.hold(gang, placed.assignments)
        return view

    gangs = [
        _gang(f"q{i}", w, g, priority=p, order=i, topology=TopologyConstraint(required=lv))
        for i, (w, g, p, lv) in enumerate(queued)
    ]
    decisions = schedule(fresh(), gangs)
    head = next(
        (
            i
            for i, d in enumerate(decisions)
            if isinstance(d, Waiting) and d.reason in {WaitReason.CAPACITY_SHORT, WaitReason.TOPOLOGY_UNSATISFIABLE}
        ),
        None,
    )
    if head is None:
        return
    replay = fresh()
    for d in decisions[:head]:
        if isinstance(d, Placed):
            replay.hold(d.gang, d.assignments)
    reserved = reservation(replay, decisions[head].gang)
    for d in decisions[head + 1 :]:
        if isinstance(d, Placed):
            assert not {a.node for a in d.assignments} & reserved


def test_events_and_specs_written_before_the_scheduler_fields_still_read() -> None:
    from lanes_contract.events import JobWaitingData, NodeRegisteredData  # noqa: PLC0415
    from lanes_contract.jobs import JobSpec  # noqa: PLC0415

    waiting = JobWaitingData.model_validate({"reason": "capacity_short", "detail": "d", "queue_position": 2})
    assert (waiting.blocking, waiting.owner_lane, waiting.figures) == ((), None, {})
    node = NodeRegisteredData.model_validate({"gpu_model": "H100", "gpus": 8, "gpu_memory_gib": 80})
    assert (node.leaf, node.pool) == (None, "default")
    spec = JobSpec.model_validate({"name": "old", "workers": 2, "gpus_per_worker": 4})
    assert (spec.pool, spec.priority, spec.topology.required) == ("default", 0, Level.CLUSTER)
