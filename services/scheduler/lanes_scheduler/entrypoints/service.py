"""The scheduler as the composition root sees it: migrations and consumers."""

from __future__ import annotations

from collections.abc import Sequence

from lanes_contract.events import Event
from lanes_contract.streams import JOBS, NODES
from lanes_runtime.consumer import ConsumerSpec, Handler, HandlerContext
from lanes_runtime.service import Bound, RunnerContext, ServiceDefinition
from lanes_runtime.store import migrations_of
from lanes_scheduler.adapters.unit_of_work import SchedulerUnitOfWork
from lanes_scheduler.service_layer.handlers import Scheduler

JOB_EVENTS = ConsumerSpec(
    durable="scheduler-jobs",
    stream=JOBS,
    subjects=("lanes.job.*.submitted", "lanes.job.*.attempt_requested", "lanes.job.*.state_changed"),
)
NODE_EVENTS = ConsumerSpec(
    durable="scheduler-nodes",
    stream=NODES,
    subjects=("lanes.node.*.registered", "lanes.node.*.state_changed", "lanes.node.*.policy_set"),
)


def handlers(scheduler: Scheduler | None = None) -> tuple[Handler, Handler]:
    """The job-event and node-event handlers of one scheduler (one decision cache), on PostgreSQL."""
    scheduler = scheduler or Scheduler()

    def unit(ctx: HandlerContext) -> SchedulerUnitOfWork:
        return SchedulerUnitOfWork(ctx.conn, ctx.stream_seq, ctx.scope if ctx.scope.deferred else None)

    async def handle_job_event(event: Event, ctx: HandlerContext) -> Sequence[Event]:
        return await scheduler.apply_job_event(event, unit(ctx))

    async def handle_node_event(event: Event, ctx: HandlerContext) -> Sequence[Event]:
        return await scheduler.apply_node_event(event, unit(ctx))

    return handle_job_event, handle_node_event


def _job_handler(_: RunnerContext) -> Handler:
    return handlers()[0]


def _node_handler(_: RunnerContext) -> Handler:
    return handlers()[1]


SERVICE = ServiceDefinition(
    name="scheduler",
    migrations=migrations_of("lanes_scheduler.adapters"),
    consumers=((JOB_EVENTS, Bound(_job_handler)), (NODE_EVENTS, Bound(_node_handler))),
)
