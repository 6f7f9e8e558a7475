"""The comparison baseline of bench/scheduler.py: first fit, all-or-nothing, nodes in id order.

Lanes placed gangs this way in its walking skeleton. The bench replays one arrival trace through it and
through the scheduler's topology-aware best fit, and reports both, so the gain is measured, not claimed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from lanes_contract.events import RankAssignment


class WaitReason(StrEnum):
    """Why a gang cannot be placed now."""

    CAPACITY_SHORT = "capacity_short"
    SPEC_MISMATCH = "spec_mismatch"


@dataclass(frozen=True)
class NodeCapacity:
    """What one node can still give: its GPU model and memory, and the indices of its free GPUs."""

    node_id: str
    gpu_model: str
    gpu_memory_gib: int
    free_gpus: tuple[int, ...]


@dataclass(frozen=True)
class GangRequest:
    """N workers that each need G GPUs of one model, placed together or not at all."""

    workers: int
    gpus_per_worker: int
    gpu_model: str | None = None


@dataclass(frozen=True)
class Blocked:
    """The gang cannot be placed; `reason` is the machine-readable cause, `detail` the sentence for humans."""

    reason: WaitReason
    detail: str


def _fits_spec(node: NodeCapacity, request: GangRequest) -> bool:
    return request.gpu_model is None or node.gpu_model == request.gpu_model


def place_first_fit(
    request: GangRequest, nodes: tuple[NodeCapacity, ...], node_sizes: dict[str, int]
) -> tuple[RankAssignment, ...] | Blocked:
    """Place every rank on the first nodes (by id) with enough free GPUs, or say why that is impossible.

    `node_sizes` is each node's total GPU count: it tells a gang that could never fit (spec mismatch)
    from one that only has to wait for capacity.
    """
    matching = [n for n in sorted(nodes, key=lambda n: n.node_id) if _fits_spec(n, request)]
    if not any(node_sizes.get(n.node_id, 0) >= request.gpus_per_worker for n in matching):
        model = request.gpu_model or "any model"
        return Blocked(
            WaitReason.SPEC_MISMATCH,
            f"no node has {request.gpus_per_worker} GPUs of {model} for one worker",
        )
    assignments: list[RankAssignment] = []
    for node in matching:
        free = list(node.free_gpus)
        while len(free) >= request.gpus_per_worker and len(assignments) < request.workers:
            taken, free = free[: request.gpus_per_worker], free[request.gpus_per_worker :]
            assignments.append(RankAssignment(rank=len(assignments), node=node.node_id, gpus=tuple(taken)))
        if len(assignments) == request.workers:
            return tuple(assignments)
    free_total = sum(len(n.free_gpus) for n in matching)
    needed = request.workers * request.gpus_per_worker
    return Blocked(
        WaitReason.CAPACITY_SHORT,
        f"needs {needed} GPUs ({request.workers}x{request.gpus_per_worker}); {free_total} matching GPUs are free",
    )
