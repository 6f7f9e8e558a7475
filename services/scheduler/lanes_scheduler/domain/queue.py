"""The scheduler's queue entries and release outcomes, and how an attempt's spec becomes a placement request."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lanes_contract.jobs import JobSpec
from lanes_scheduler.domain.admission import Gang


@dataclass(frozen=True)
class PendingJob:
    """A job attempt waiting for placement, with the reason it was last given."""

    gang: Gang
    wait_reason: str | None
    wait_detail: str | None = None
    queue_position: int | None = None


@dataclass(frozen=True)
class Release:
    """What a release request did: freed these nodes/GPUs, or was refused (double or unknown)."""

    outcome: str
    nodes: tuple[str, ...] = ()
    gpus: int = 0


def gang_of(job_id: str, attempt: int, spec: JobSpec, order: int, *, avoid_nodes: Iterable[str] = ()) -> Gang:
    """The placement request of one attempt of a job, kept off the nodes it must avoid."""
    return Gang(
        job_id=job_id,
        attempt=attempt,
        workers=spec.workers,
        gpus_per_worker=spec.gpus_per_worker,
        gpu_model=spec.gpu_model,
        gpu_memory_gib=spec.gpu_memory_gib,
        tenant=spec.tenant,
        pool=spec.pool,
        priority=spec.priority,
        order=order,
        topology=spec.topology,
        avoid_nodes=frozenset(avoid_nodes),
    )
