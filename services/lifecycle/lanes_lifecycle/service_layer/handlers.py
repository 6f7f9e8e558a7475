"""Lifecycle handler: fold one job event into the job's view and publish the state change it causes."""

from __future__ import annotations

from collections.abc import Sequence

from lanes_common.consumer import HandlerContext
from lanes_common.events import Event, JobStateChanged, JobStateChangedData, derive
from lanes_lifecycle.adapters import repository
from lanes_lifecycle.domain.job import evolve

SOURCE = "lanes/lifecycle"


async def handle_job_event(event: Event, ctx: HandlerContext) -> Sequence[Event]:
    """Apply the event to its job; an illegal event raises IllegalTransitionError and is dead-lettered."""
    view = await repository.load(ctx.conn, event.job_key, for_update=True)
    after, transition = evolve(view, event)
    await repository.save(ctx.conn, after)
    if transition is None:
        return []
    changed = JobStateChangedData(
        from_state=transition.from_state,
        to_state=transition.to_state,
        cause_type=event.type,
        reason=transition.reason,
    )
    return [derive(JobStateChanged, event, source=SOURCE, attempt=after.current.number, data=changed)]
