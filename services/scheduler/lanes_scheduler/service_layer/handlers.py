"""Scheduler handlers: apply one event inside the consumer's transaction, return the events it causes."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

import structlog

from lanes_contract.errors import PoisonEventError
from lanes_contract.events import (
    AttemptRequested,
    ClusterPolicySet,
    Event,
    JobPlaced,
    JobPlacedData,
    JobRejected,
    JobRejectedData,
    JobStateChanged,
    JobSubmitted,
    JobWaiting,
    JobWaitingData,
    NodeRegistered,
    NodeStateChanged,
    ResourcesReleased,
    ResourcesReleasedData,
    derive,
)
from lanes_contract.jobs import JobSpec, JobState
from lanes_contract.topology import NodeStatus
from lanes_runtime.consumer import HandlerContext
from lanes_scheduler.adapters import repository
from lanes_scheduler.domain.admission import CapacityView, Placed, Rejected, schedule

SOURCE = "lanes/scheduler"
TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
log = structlog.get_logger(__name__)

# What this process left behind after its last decision, by the state token it wrote with it: the capacity
# view and the queue. They are reused only when the database still holds that token, i.e. no other process
# and no rolled-back transaction changed anything since. Tokens are random, so the state of one database is
# never taken for another's.
_STATES: dict[str, _State] = {}
_MAX_STATES = 8


@dataclass
class _State:
    view: CapacityView
    pending: dict[tuple[str, int], repository.PendingJob]


async def _reusable_state(ctx: HandlerContext) -> tuple[str, _State | None]:
    token = await repository.state_token(ctx.conn)
    return token, _STATES.pop(token, None)


def _put_back(token: str, state: _State | None) -> None:
    if state is not None:
        _STATES[token] = state


async def _queue(
    ctx: HandlerContext,
    state: _State | None,
    job_id: str,
    attempt: int,
    spec: JobSpec,
    *,
    avoid_nodes: tuple[str, ...] = (),
) -> bool:
    added = await repository.add_pending_job(ctx.conn, job_id, attempt, spec, ctx.stream_seq, avoid_nodes=avoid_nodes)
    if added and state is not None:
        gang = repository.gang_of(job_id, attempt, spec, ctx.stream_seq, avoid_nodes=avoid_nodes)
        state.pending[(job_id, attempt)] = repository.PendingJob(gang, None)
    return added


async def handle_job_event(event: Event, ctx: HandlerContext) -> Sequence[Event]:
    """Queue submitted jobs and new attempts, free the allocation of finished ones; then place what waits."""
    if _observed(event):
        return []  # another system places this job (observe mode): nothing to queue, hold or free
    if isinstance(event, JobStateChanged) and event.data.to_state not in TERMINAL:
        return []  # only the end of an attempt concerns the scheduler
    await repository.lock_scheduling(ctx.conn)
    token, state = await _reusable_state(ctx)
    if isinstance(event, JobSubmitted):
        added = await _queue(ctx, state, event.job_key, event.attempt or 1, event.data.spec)
        if not added:
            _put_back(token, state)
            return []
        return await _schedule(event, ctx, state)
    if isinstance(event, AttemptRequested):
        spec = await repository.original_spec(ctx.conn, event.job_key)
        if spec is None:
            msg = f"attempt {event.attempt} of job {event.jobid} requested, but the job was never submitted"
            raise PoisonEventError(msg)
        added = await _queue(ctx, state, event.job_key, event.attempt or 1, spec, avoid_nodes=event.data.avoid_nodes)
        if not added:
            _put_back(token, state)
            return []
        return await _schedule(event, ctx, state)
    if isinstance(event, JobStateChanged):
        attempt = event.attempt or 1
        released = await repository.release(ctx.conn, event.job_key, attempt, event.id, event.time)
        if released.outcome != "released":
            _put_back(token, state)  # nothing changed: the state is still the one the token names
            return []
        if state is not None:
            state.view.release(f"{event.job_key}/{attempt}")
            state.pending.pop((event.job_key, attempt), None)  # a job cancelled while it waited
        data = ResourcesReleasedData(nodes=released.nodes, gpus=released.gpus)
        freed = derive(ResourcesReleased, event, source=SOURCE, data=data)
        return [freed, *await _schedule(event, ctx, state)]
    msg = f"the scheduler does not handle {event.type} on the job stream"
    raise PoisonEventError(msg)


def _observed(event: Event) -> bool:
    """A submission or new attempt of a job that another system (e.g. Slurm) places and runs."""
    if isinstance(event, JobSubmitted):
        return event.data.spec.managed_by is not None
    return isinstance(event, AttemptRequested) and event.data.managed_by is not None


async def handle_node_event(event: Event, ctx: HandlerContext) -> Sequence[Event]:
    """Record inventory, node states and policy; any of them may let waiting jobs run (or change why not)."""
    await repository.lock_scheduling(ctx.conn)
    if isinstance(event, NodeRegistered):
        await repository.upsert_node(ctx.conn, event.node_key, event.data)
    elif isinstance(event, NodeStateChanged):
        status = NodeStatus(
            state=event.data.state, reason=event.data.reason, owner_lane=event.lane.value, since=event.time
        )
        if not await repository.set_node_state(ctx.conn, event.node_key, status):
            log.warning("state change for an unknown node ignored", node=event.node, state=event.data.state)
            return []
    elif isinstance(event, ClusterPolicySet):
        await repository.set_policy(ctx.conn, event.data.policy)
    else:
        msg = f"the scheduler does not handle {event.type} on the node stream"
        raise PoisonEventError(msg)
    return await _schedule(event, ctx, None)  # the inventory changed: rebuild the view from the projection


async def _load(ctx: HandlerContext) -> _State:
    view = CapacityView(
        await repository.nodes(ctx.conn), await repository.policy(ctx.conn), await repository.holdings(ctx.conn)
    )
    pending = {(p.gang.job_id, p.gang.attempt): p for p in await repository.pending_jobs(ctx.conn)}
    return _State(view, pending)


async def _schedule(cause: Event, ctx: HandlerContext, state: _State | None) -> list[Event]:
    """Decide every waiting attempt; publish placements, rejections and changed wait reasons."""
    state = state or await _load(ctx)
    outputs: list[Event] = []
    for decision in schedule(state.view, [p.gang for p in state.pending.values()]):
        gang = decision.gang
        ref = (gang.job_id, gang.attempt)
        key = f"{gang.job_id}/{gang.attempt}"
        ids: dict[str, str | int] = {"source": SOURCE, "jobid": gang.job_id, "attempt": gang.attempt}
        if isinstance(decision, Placed):
            waited = state.pending.pop(ref).wait_reason is not None
            await repository.allocate(ctx.conn, gang, decision.assignments)
            if waited:
                await repository.close_wait(ctx.conn, gang.job_id, gang.attempt, cause.time, "placed")
            outputs.append(
                derive(
                    JobPlaced,
                    cause,
                    key=key,
                    **ids,
                    data=JobPlacedData(
                        assignments=decision.assignments, level=str(decision.level), domain=decision.domain
                    ),
                )
            )
        elif isinstance(decision, Rejected):
            del state.pending[ref]
            await repository.reject(ctx.conn, gang)
            await repository.close_wait(ctx.conn, gang.job_id, gang.attempt, cause.time, "rejected")
            data = JobRejectedData(
                reason=decision.reason.value,
                detail=decision.detail,
                owner_lane=decision.owner_lane,
                figures=dict(decision.figures),
            )
            outputs.append(derive(JobRejected, cause, key=key, **ids, data=data))
        else:
            last = state.pending[ref]
            changed = last.wait_reason != decision.reason.value
            if changed or (last.wait_detail, last.queue_position) != (decision.detail, decision.queue_position):
                await repository.record_wait(ctx.conn, decision, ctx.stream_seq, cause.time, changed=changed)
                state.pending[ref] = replace(
                    last,
                    wait_reason=decision.reason.value,
                    wait_detail=decision.detail,
                    queue_position=decision.queue_position,
                )
            if changed:
                waiting = JobWaitingData(
                    reason=decision.reason.value,
                    detail=decision.detail,
                    queue_position=decision.queue_position,
                    owner_lane=decision.owner_lane,
                    blocking=decision.blocking,
                    figures=dict(decision.figures),
                )
                outputs.append(derive(JobWaiting, cause, key=key, **ids, data=waiting))
    await _keep(ctx, state)
    return outputs


async def _keep(ctx: HandlerContext, state: _State | None) -> None:
    """Write a fresh state token in this transaction and remember the state by it (if there is one)."""
    token = uuid.uuid4().hex
    await repository.set_state_token(ctx.conn, token)
    if state is not None:
        while len(_STATES) >= _MAX_STATES:
            _STATES.pop(next(iter(_STATES)))
        _STATES[token] = state
