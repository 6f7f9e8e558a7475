"""Unit tests for the scheduler's gang placement (``place_first_fit``), a pure function."""

from __future__ import annotations

import itertools

import pytest
from baselines.first_fit import Blocked, GangRequest, NodeCapacity, WaitReason, place_first_fit
from hypothesis import given, settings
from hypothesis import strategies as st

from lanes_contract.events import RankAssignment


def _node(node_id: str, free: int | tuple[int, ...], *, model: str = "H100", memory: int = 80) -> NodeCapacity:
    free_gpus = tuple(range(free)) if isinstance(free, int) else free
    return NodeCapacity(node_id=node_id, gpu_model=model, gpu_memory_gib=memory, free_gpus=free_gpus)


def _sizes(*nodes: NodeCapacity, size: int = 8) -> dict[str, int]:
    return {node.node_id: size for node in nodes}


def test_places_every_rank_on_the_first_nodes_by_id():
    nodes = (_node("node-b", 8), _node("node-a", 8), _node("node-c", 8))
    placed = place_first_fit(GangRequest(workers=3, gpus_per_worker=4, gpu_model="H100"), nodes, _sizes(*nodes))
    assert placed == (
        RankAssignment(rank=0, node="node-a", gpus=(0, 1, 2, 3)),
        RankAssignment(rank=1, node="node-a", gpus=(4, 5, 6, 7)),
        RankAssignment(rank=2, node="node-b", gpus=(0, 1, 2, 3)),
    )


def test_takes_only_the_free_gpus_in_their_given_order():
    nodes = (_node("node-a", (6, 1, 3)),)
    placed = place_first_fit(GangRequest(workers=1, gpus_per_worker=2), nodes, _sizes(*nodes))
    assert placed == (RankAssignment(rank=0, node="node-a", gpus=(6, 1)),)


def test_skips_nodes_without_room_for_one_worker():
    nodes = (_node("node-a", 3), _node("node-b", 4))
    placed = place_first_fit(GangRequest(workers=1, gpus_per_worker=4), nodes, _sizes(*nodes))
    assert placed == (RankAssignment(rank=0, node="node-b", gpus=(0, 1, 2, 3)),)


def test_is_all_or_nothing():
    # Two of the three workers would fit: that is not a placement.
    nodes = (_node("node-a", 4), _node("node-b", 4), _node("node-c", 3))
    blocked = place_first_fit(GangRequest(workers=3, gpus_per_worker=4), nodes, _sizes(*nodes))
    assert isinstance(blocked, Blocked)
    assert blocked.reason is WaitReason.CAPACITY_SHORT
    assert blocked.detail == "needs 12 GPUs (3x4); 11 matching GPUs are free"


def test_any_model_matches_when_the_request_names_none():
    nodes = (_node("node-a", 2, model="A100"), _node("node-b", 2, model="H100"))
    placed = place_first_fit(GangRequest(workers=2, gpus_per_worker=2), nodes, _sizes(*nodes))
    assert isinstance(placed, tuple)
    assert [a.node for a in placed] == ["node-a", "node-b"]


def test_only_nodes_of_the_requested_model_are_used():
    nodes = (_node("node-a", 8, model="A100"), _node("node-b", 8, model="H100"))
    placed = place_first_fit(GangRequest(workers=2, gpus_per_worker=4, gpu_model="H100"), nodes, _sizes(*nodes))
    assert isinstance(placed, tuple)
    assert {a.node for a in placed} == {"node-b"}


@pytest.mark.parametrize(
    ("request_", "nodes", "sizes"),
    [
        pytest.param(
            GangRequest(workers=1, gpus_per_worker=1, gpu_model="H100"),
            (_node("node-a", 8, model="A100"),),
            {"node-a": 8},
            id="no-node-of-the-model",
        ),
        pytest.param(
            GangRequest(workers=1, gpus_per_worker=16, gpu_model="H100"),
            (_node("node-a", 8), _node("node-b", 8)),
            {"node-a": 8, "node-b": 8},
            id="no-node-big-enough-for-one-worker",
        ),
        pytest.param(
            GangRequest(workers=1, gpus_per_worker=4, gpu_model="H100"),
            (_node("node-a", 8, model="A100"), _node("node-b", 2)),
            {"node-a": 8, "node-b": 2},
            id="big-node-is-the-wrong-model",
        ),
        pytest.param(GangRequest(workers=1, gpus_per_worker=1), (), {}, id="empty-cluster"),
    ],
)
def test_spec_mismatch_when_no_node_could_ever_hold_one_worker(request_, nodes, sizes):
    blocked = place_first_fit(request_, nodes, sizes)
    assert isinstance(blocked, Blocked)
    assert blocked.reason is WaitReason.SPEC_MISMATCH
    assert str(request_.gpus_per_worker) in blocked.detail
    assert (request_.gpu_model or "any model") in blocked.detail


def test_spec_mismatch_is_judged_on_node_size_not_on_free_gpus():
    # The node is the right size but all its GPUs are busy: wait for capacity, not a spec mismatch.
    nodes = (_node("node-a", ()), _node("node-b", (5,)))
    blocked = place_first_fit(GangRequest(workers=1, gpus_per_worker=4, gpu_model="H100"), nodes, _sizes(*nodes))
    assert blocked == Blocked(WaitReason.CAPACITY_SHORT, "needs 4 GPUs (1x4); 1 matching GPUs are free")


def test_capacity_short_counts_only_matching_gpus():
    nodes = (_node("node-a", 8, model="A100"), _node("node-b", 1))
    blocked = place_first_fit(GangRequest(workers=1, gpus_per_worker=2, gpu_model="H100"), nodes, _sizes(*nodes))
    assert isinstance(blocked, Blocked)
    assert blocked.reason is WaitReason.CAPACITY_SHORT
    assert "1 matching GPUs are free" in blocked.detail


def test_output_does_not_depend_on_the_order_of_the_snapshot():
    nodes = (_node("n3", (0, 2, 4)), _node("n1", (1, 3)), _node("n2", (7,)), _node("n4", 8, model="A100"))
    request = GangRequest(workers=3, gpus_per_worker=1, gpu_model="H100")
    results = {place_first_fit(request, order, _sizes(*nodes)) for order in itertools.permutations(nodes)}
    assert results == {
        (
            RankAssignment(rank=0, node="n1", gpus=(1,)),
            RankAssignment(rank=1, node="n1", gpus=(3,)),
            RankAssignment(rank=2, node="n2", gpus=(7,)),
        )
    }


def test_inputs_are_not_changed():
    nodes = (_node("node-a", 8), _node("node-b", 8))
    sizes = _sizes(*nodes)
    place_first_fit(GangRequest(workers=3, gpus_per_worker=4), nodes, sizes)
    assert nodes == (_node("node-a", 8), _node("node-b", 8))
    assert sizes == {"node-a": 8, "node-b": 8}


# --- property: random clusters -------------------------------------------------------------------

_MODELS = ["A100", "H100"]


@st.composite
def _clusters(draw: st.DrawFn) -> tuple[tuple[NodeCapacity, ...], dict[str, int]]:
    node_ids = draw(st.lists(st.from_regex(r"node-[a-z0-9]{1,3}", fullmatch=True), unique=True, max_size=6))
    nodes: list[NodeCapacity] = []
    sizes: dict[str, int] = {}
    for node_id in node_ids:
        size = draw(st.integers(min_value=0, max_value=8))
        # Free GPUs: a random subset of the node's indices, in a random order.
        order = draw(st.permutations(list(range(size))))
        free = order[: draw(st.integers(min_value=0, max_value=size))]
        nodes.append(_node(node_id, tuple(free), model=draw(st.sampled_from(_MODELS))))
        sizes[node_id] = size
    return tuple(nodes), sizes


@settings(max_examples=400)
@given(
    cluster=_clusters(),
    workers=st.integers(min_value=1, max_value=6),
    gpus_per_worker=st.integers(min_value=1, max_value=8),
    gpu_model=st.none() | st.sampled_from(_MODELS),
)
def test_placement_property(cluster, workers, gpus_per_worker, gpu_model):
    nodes, sizes = cluster
    request = GangRequest(workers=workers, gpus_per_worker=gpus_per_worker, gpu_model=gpu_model)
    by_id = {node.node_id: node for node in nodes}
    matching = [n for n in nodes if gpu_model is None or n.gpu_model == gpu_model]
    result = place_first_fit(request, nodes, sizes)

    assert result == place_first_fit(request, tuple(reversed(nodes)), sizes)  # deterministic
    if not any(sizes[n.node_id] >= gpus_per_worker for n in matching):
        assert result == Blocked(
            WaitReason.SPEC_MISMATCH, f"no node has {gpus_per_worker} GPUs of {gpu_model or 'any model'} for one worker"
        )
        return
    # Whole workers per node is all that matters for a homogeneous gang, so first-fit finds a placement
    # exactly when one exists.
    fits = sum(len(n.free_gpus) // gpus_per_worker for n in matching) >= workers
    if not fits:
        assert isinstance(result, Blocked)
        assert result.reason is WaitReason.CAPACITY_SHORT
        return
    assert isinstance(result, tuple)
    assert [a.rank for a in result] == list(range(workers))
    taken = [(a.node, gpu) for a in result for gpu in a.gpus]
    assert len(taken) == len(set(taken)), "a GPU was assigned twice"
    for assignment in result:
        node = by_id[assignment.node]
        assert len(assignment.gpus) == gpus_per_worker
        assert set(assignment.gpus) <= set(node.free_gpus)
        assert gpu_model is None or node.gpu_model == gpu_model
    # First fit: ranks fill nodes in id order, so node ids never go down with the rank.
    placed_nodes = [a.node for a in result]
    assert placed_nodes == sorted(placed_nodes)
