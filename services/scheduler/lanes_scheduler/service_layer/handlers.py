"""Scheduler handlers: apply one event inside the consumer's transaction, return the events it causes."""

from __future__ import annotations

from collections.abc import Sequence

from lanes_common.consumer import HandlerContext
from lanes_common.errors import PoisonEventError
from lanes_common.events import (
    Event,
    JobPlaced,
    JobPlacedData,
    JobStateChanged,
    JobSubmitted,
    JobWaiting,
    JobWaitingData,
    NodeRegistered,
    ResourcesReleased,
    ResourcesReleasedData,
    derive,
)
from lanes_common.jobs import JobState
from lanes_scheduler.adapters import repository
from lanes_scheduler.domain.placement import Blocked, GangRequest, place_first_fit

SOURCE = "lanes/scheduler"
TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


async def handle_job_event(event: Event, ctx: HandlerContext) -> Sequence[Event]:
    """Queue submitted jobs and free the allocation of finished ones; then try to place what waits."""
    await repository.lock_scheduling(ctx.conn)
    if isinstance(event, JobSubmitted):
        spec = event.data.spec
        request = GangRequest(spec.workers, spec.gpus_per_worker, spec.gpu_model)
        await repository.add_pending_job(ctx.conn, event.job_key, event.attempt or 1, request, ctx.stream_seq)
        return await _schedule(event, ctx)
    if isinstance(event, JobStateChanged):
        if event.data.to_state not in TERMINAL:
            return []
        released = await repository.release(ctx.conn, event.job_key, event.attempt or 1)
        if released is None:
            return []
        nodes, gpus = released
        freed = derive(ResourcesReleased, event, source=SOURCE, data=ResourcesReleasedData(nodes=nodes, gpus=gpus))
        return [freed, *await _schedule(event, ctx)]
    msg = f"the scheduler does not handle {event.type} on the job stream"
    raise PoisonEventError(msg)


async def handle_node_event(event: Event, ctx: HandlerContext) -> Sequence[Event]:
    """Record node inventory; new capacity may let waiting jobs run."""
    await repository.lock_scheduling(ctx.conn)
    if isinstance(event, NodeRegistered):
        await repository.upsert_node(ctx.conn, event.node_key, event.data)
        return await _schedule(event, ctx)
    msg = f"the scheduler does not handle {event.type} on the node stream"
    raise PoisonEventError(msg)


async def _schedule(cause: Event, ctx: HandlerContext) -> list[Event]:
    """Try every waiting job in submission order; publish placements and changed wait reasons."""
    nodes, sizes = await repository.capacity(ctx.conn)
    outputs: list[Event] = []
    for position, job in enumerate(await repository.pending_jobs(ctx.conn), start=1):
        result = place_first_fit(job.request, nodes, sizes)
        if isinstance(result, Blocked):
            if job.wait_reason != result.reason:
                await repository.set_wait_reason(ctx.conn, job, result.reason)
                data = JobWaitingData(reason=result.reason, detail=result.detail, queue_position=position)
                outputs.append(
                    derive(
                        JobWaiting,
                        cause,
                        key=job.job_id,
                        source=SOURCE,
                        jobid=job.job_id,
                        attempt=job.attempt,
                        data=data,
                    )
                )
            continue
        await repository.allocate(ctx.conn, job, result)
        nodes, sizes = await repository.capacity(ctx.conn)
        outputs.append(
            derive(
                JobPlaced,
                cause,
                key=job.job_id,
                source=SOURCE,
                jobid=job.job_id,
                attempt=job.attempt,
                data=JobPlacedData(assignments=result),
            )
        )
    return outputs
