"""The lifecycle as the composition root sees it: migrations, the job-event consumer and the job API."""

from __future__ import annotations

from collections.abc import Sequence

from nats.js import JetStreamContext

from lanes_contract.events import Event
from lanes_contract.streams import JOBS
from lanes_lifecycle.adapters.repository import ParsedViews
from lanes_lifecycle.adapters.unit_of_work import JetStreamTransitions, LifecycleUnitOfWork
from lanes_lifecycle.entrypoints.job_api import JobApi
from lanes_lifecycle.service_layer.handlers import apply_job_event
from lanes_runtime.consumer import ConsumerSpec, Handler, HandlerContext
from lanes_runtime.service import Bound, RunnerContext, ServiceDefinition
from lanes_runtime.store import migrations_of

LIFECYCLE_INPUTS = (
    "submitted",
    "waiting",
    "rejected",
    "placed",
    "rank_started",
    "rendezvous_done",
    "communicator_ready",
    "heartbeat",
    "checkpoint_started",
    "checkpoint_saved",
    "artifact_produced",
    "rank_exited",
    "cancel_requested",
    "retry_requested",
    "hold_requested",
    "resume_requested",
    "resources_released",
    "finding",
)
"""The subject names (`lanes.job.*.<name>`) the lifecycle folds; a rebuild replays exactly these."""

JOB_EVENTS = ConsumerSpec(
    durable="lifecycle-jobs",
    stream=JOBS,
    subjects=tuple(f"lanes.job.*.{name}" for name in LIFECYCLE_INPUTS),
    # The fold depends on order (a rank cannot exit before its placement): each job's events are applied in
    # stream order across crashes and replicas, many jobs per transaction (docs/ordering.md).
    # A fold reads and writes each job it touches once: the more events per fold, the fewer reads and writes
    # per event when many jobs interleave (bench/pipeline.py, 100 jobs interleaved: 64 -> 1,316/s, 256 -> 2,100/s).
    batch=256,
    ordered=True,
)


def job_event_handler(js: JetStreamContext) -> Handler:
    """The lifecycle's handler, with its transition log on `js` and its repository on the consumer's transaction."""
    transitions = JetStreamTransitions(js)
    parsed = ParsedViews()

    async def handle(event: Event, ctx: HandlerContext) -> Sequence[Event]:
        return await apply_job_event(event, LifecycleUnitOfWork(ctx.conn, transitions, ctx.scope, parsed))

    return handle


def _bound_handler(context: RunnerContext) -> Handler:
    return job_event_handler(context.nc.jetstream())


SERVICE = ServiceDefinition(
    name="lifecycle",
    migrations=migrations_of("lanes_lifecycle.adapters"),
    consumers=((JOB_EVENTS, Bound(_bound_handler)),),
    # The process that owns the projection also answers `lanes.api.job.*` (submit, cancel, retry, get).
    runners=(lambda context: JobApi(context.nc, context.pool),),
)
