"""Lifecycle handler: fold one job event into the job's view, publish the state change it causes.

An event the job's state does not allow becomes a `transition_rejected` event on the job's timeline and
leaves the projection untouched (it is not dead-lettered: it is a fact about the job, not a broken message).
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from lanes_contract.events import (
    AttemptRequested,
    AttemptRequestedData,
    Event,
    JobStateChanged,
    JobStateChangedData,
    TransitionRejected,
    TransitionRejectedData,
    derive,
)
from lanes_lifecycle.domain.job import IllegalTransitionError, JobView, Transition, evolve
from lanes_lifecycle.service_layer.ports import UnitOfWork

SOURCE = "lanes/lifecycle"
log = structlog.get_logger(__name__)


def state_changed(event: Event, after: JobView, transition: Transition) -> JobStateChanged:
    """The state-change event of a transition (its id derives from the cause, so a re-run gives the same id)."""
    data = JobStateChangedData(
        from_state=transition.from_state,
        to_state=transition.to_state,
        cause_type=event.type,
        reason=transition.reason,
        cause=transition.cause,
        sequence=transition.sequence,
    )
    return derive(JobStateChanged, event, source=SOURCE, attempt=after.current.number, data=data)


def rejected(event: Event, view: JobView | None, error: IllegalTransitionError) -> TransitionRejected:
    """The visible record of an event the job's state did not allow."""
    data = TransitionRejectedData(
        event_type=event.type, event_id=event.id, state=view.state if view else None, reason=str(error)
    )
    return derive(TransitionRejected, event, source=SOURCE, data=data)


async def apply_job_event(event: Event, uow: UnitOfWork) -> Sequence[Event]:
    """Apply the event to its job; append the state change it causes to the job's chain on the log.

    The state change is appended before the projection commits, under optimistic concurrency (so two
    writers cannot both decide it); the events returned go through the consumer's outbox.
    """
    view = await uow.jobs.load(event.job_key)
    try:
        after, transition = evolve(view, event)
    except IllegalTransitionError as exc:
        log.info("transition rejected", reason=str(exc), event_type=event.type)
        return [rejected(event, view, exc)]
    if transition is None:
        await uow.jobs.save(after)
        return []
    await uow.jobs.save(after, transition=state_changed(event, after, transition))
    if transition.new_attempt is None:
        return []
    requested = AttemptRequestedData(
        reason=transition.reason,
        resume_step=transition.resume_step,
        avoid_nodes=transition.avoid_nodes,
        managed_by=after.spec.managed_by,
    )
    return [derive(AttemptRequested, event, source=SOURCE, attempt=transition.new_attempt, data=requested)]
